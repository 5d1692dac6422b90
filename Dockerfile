# The mountmedic image: one static binary on an empty base, nothing else.
#
# Why FROM scratch and no build stage: the machines that build this image reach
# no container registry (only the Go module proxy, apt and npm), so a multi-stage
# Dockerfile that pulls a golang image cannot build here. scripts/image.sh builds
# the binary first with the local Go toolchain
#
#   CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X main.version=$VERSION" ./cmd/mountmedic
#
# into a context directory holding only that binary, then runs
# `buildah bud -f Dockerfile <context>`, which needs no base image and no daemon.
# The repository root also works as a context (`go build -o mountmedic
# ./cmd/mountmedic && buildah bud .`): .dockerignore lets only ./mountmedic in.
#
# What is not in the image, on purpose: no shell, no libc, no CA bundle (the
# agent talks only to the API server, whose CA comes with the service account
# token), no /etc/passwd (USER is numeric), no /tmp (the DaemonSet mounts an
# emptyDir there; the root filesystem is mounted read-only).
#
# USER 0: the agent mounts and unmounts filesystems, enters container mount
# namespaces and aborts FUSE connections. It runs privileged; see
# docs/security.md.
FROM scratch

ARG VERSION=dev
ARG REVISION=unknown
ARG CREATED=1970-01-01T00:00:00Z

LABEL org.opencontainers.image.title="mountmedic" \
      org.opencontainers.image.description="Finds pod volume mounts that died under running pods and repairs them" \
      org.opencontainers.image.source="https://github.com/mountmedic/mountmedic" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}"

COPY mountmedic /mountmedic

USER 0:0
ENTRYPOINT ["/mountmedic"]
CMD ["agent"]

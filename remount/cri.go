package remount

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/klog/v2"
)

// Labels kubelet puts on every container it creates through the CRI.
const (
	criPodUIDLabel        = "io.kubernetes.pod.uid"
	criPodNameLabel       = "io.kubernetes.pod.name"
	criPodNamespaceLabel  = "io.kubernetes.pod.namespace"
	criContainerNameLabel = "io.kubernetes.container.name"
)

// ErrRuntimeUnavailable marks a container runtime that is down: its socket is
// missing or refuses connections, or a call ended with gRPC Unavailable or
// ran out of time before a connection was up. Retry later.
var ErrRuntimeUnavailable = errors.New("container runtime unavailable")

// DefaultCRITimeout bounds each CRI call (StopContainer gets the grace period
// on top).
const DefaultCRITimeout = 10 * time.Second

// CRIOptions configures a CRIClient. Zero fields take the defaults.
type CRIOptions struct {
	// Timeout bounds each call.
	Timeout time.Duration
}

// CRIClient talks to the container runtime's CRI socket (containerd, CRI-O)
// for the one thing remount needs from it: stopping a pod's running
// containers so that kubelet starts them again, onto fresh mounts. It is
// safe for concurrent use.
type CRIClient struct {
	path string
	opts CRIOptions
	conn *grpc.ClientConn
	rt   runtimeapi.RuntimeServiceClient
}

// DialCRI prepares a client for the CRI socket at endpoint (an absolute path
// or a unix:// URL, e.g. unix:///run/containerd/containerd.sock). A missing
// socket is ErrRuntimeUnavailable; anything but a unix socket is refused. No
// connection is made until the first call.
func DialCRI(ctx context.Context, endpoint string, opts CRIOptions) (*CRIClient, error) {
	p, err := socketPath("cri", endpoint)
	if err != nil {
		return nil, err
	}
	if err := checkSocket("cri", p, ErrRuntimeUnavailable); err != nil {
		return nil, err
	}
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultCRITimeout
	}
	conn, err := grpc.NewClient("unix://"+p,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithNoProxy(),
		grpc.WithAuthority("localhost"),
	)
	if err != nil {
		return nil, fmt.Errorf("cri client for %s: %w", p, err)
	}
	klog.FromContext(ctx).V(4).Info("CRI client ready", "endpoint", p)
	return &CRIClient{path: p, opts: opts, conn: conn, rt: runtimeapi.NewRuntimeServiceClient(conn)}, nil
}

// Endpoint is the socket path.
func (c *CRIClient) Endpoint() string { return c.path }

// Close releases the connection.
func (c *CRIClient) Close() error { return c.conn.Close() }

func (c *CRIClient) call(ctx context.Context, method string, timeout time.Duration, rpc func(context.Context) error) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	err := rpc(ctx)
	if err == nil {
		return nil
	}
	unavailable := false
	switch status.Code(err) {
	case codes.Unavailable:
		unavailable = true
	case codes.DeadlineExceeded:
		unavailable = c.conn.GetState() != connectivity.Ready
	}
	if unavailable {
		err = fmt.Errorf("cri %s on %s: %w: %w", method, c.path, ErrRuntimeUnavailable, err)
	} else {
		err = fmt.Errorf("cri %s on %s: %w", method, c.path, err)
	}
	klog.FromContext(ctx).V(4).Info("CRI call failed", "method", method, "err", err)
	return err
}

// Container is a running container of a pod, as the runtime lists it.
type Container struct {
	ID           string
	Name         string
	PodUID       string
	PodName      string
	PodNamespace string
	Attempt      uint32
}

// podContainers lists the running containers of the pod with UID podUID, by
// the label kubelet sets on each of them.
func (c *CRIClient) podContainers(ctx context.Context, podUID string) ([]Container, error) {
	if podUID == "" {
		return nil, errors.New("list containers: empty pod UID")
	}
	var resp *runtimeapi.ListContainersResponse
	err := c.call(ctx, "ListContainers", c.opts.Timeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{
			State:         &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_RUNNING},
			LabelSelector: map[string]string{criPodUIDLabel: podUID},
		}})
		return err
	})
	if err != nil {
		return nil, err
	}
	var out []Container
	for _, ct := range resp.GetContainers() {
		// The runtime filters already; a runtime that ignores the filter
		// must not make us stop another pod's containers.
		if ct.GetLabels()[criPodUIDLabel] != podUID || ct.GetState() != runtimeapi.ContainerState_CONTAINER_RUNNING {
			continue
		}
		name := ct.GetLabels()[criContainerNameLabel]
		if name == "" {
			name = ct.GetMetadata().GetName()
		}
		out = append(out, Container{
			ID: ct.GetId(), Name: name, PodUID: podUID,
			PodName: ct.GetLabels()[criPodNameLabel], PodNamespace: ct.GetLabels()[criPodNamespaceLabel],
			Attempt: ct.GetMetadata().GetAttempt(),
		})
	}
	slices.SortFunc(out, func(a, b Container) int { return strings.Compare(a.Name, b.Name) })
	return out, nil
}

// StopContainer stops container id, giving it grace to exit after SIGTERM.
// The call may take grace plus the client's timeout. A container the runtime
// no longer knows is an error for which status.Code gives codes.NotFound.
func (c *CRIClient) StopContainer(ctx context.Context, id string, grace time.Duration) error {
	secs := int64((grace + time.Second - 1) / time.Second)
	return c.call(ctx, "StopContainer", grace+c.opts.Timeout, func(ctx context.Context) error {
		_, err := c.rt.StopContainer(ctx, &runtimeapi.StopContainerRequest{ContainerId: id, Timeout: secs})
		return err
	})
}

// containerPID returns the host PID of a running container's init process,
// from the runtime's verbose status (containerd and CRI-O put it in the
// "info" JSON as "pid"). Use it where pods have no cgroup of their own for
// the cgroup scan (PodPIDs) to find.
func (c *CRIClient) containerPID(ctx context.Context, id string) (int, error) {
	var resp *runtimeapi.ContainerStatusResponse
	err := c.call(ctx, "ContainerStatus", c.opts.Timeout, func(ctx context.Context) error {
		var err error
		resp, err = c.rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: id, Verbose: true})
		return err
	})
	if err != nil {
		return 0, err
	}
	keys := make([]string, 0, len(resp.GetInfo()))
	for k := range resp.GetInfo() {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	if i := slices.Index(keys, "info"); i > 0 {
		keys[0], keys[i] = keys[i], keys[0]
	}
	for _, k := range keys {
		var v struct {
			Pid int `json:"pid"`
		}
		if json.Unmarshal([]byte(resp.GetInfo()[k]), &v) == nil && v.Pid > 0 {
			return v.Pid, nil
		}
	}
	return 0, fmt.Errorf("cri ContainerStatus of %s on %s: no pid in the verbose info", id, c.path)
}

// defaultStopGrace is the grace period Restarter gives a container.
const defaultStopGrace = 30 * time.Second

// Restarter stops a pod's running containers through the CRI so that kubelet
// starts them again (tier 3 of the repair ladder). A new container gets new
// bind mounts of the volume, from the (re-published) publish target; but
// kubelet reuses an existing subPath bind under volume-subpaths, so the
// caller first unmounts the dead subPath binds (Unmounter.UnmountMounts) for
// kubelet to bind them afresh. kubelet restarts a stopped container only
// under restartPolicy Always, or OnFailure (a stopped container exits non
// zero); the caller checks the pod's policy.
type Restarter struct {
	CRI *CRIClient
	// Grace is the time a container has to exit after SIGTERM;
	// defaultStopGrace when zero.
	Grace time.Duration
	// DryRun lists the containers and returns the plan without stopping
	// any.
	DryRun bool
}

// Restart stops the running containers of pod podUID, only those named in
// names when any are given, listing them once and stopping them all at
// once. It returns the containers it
// stopped (in dry-run: would stop), for the caller to wait for them to run
// again: a container that is gone by the time it is stopped counts as
// stopped (kubelet starts it again all the same); one whose stop failed does
// not. A name given that no running container has is an opSkip action.
func (r *Restarter) Restart(ctx context.Context, podUID string, names ...string) ([]Container, []Action, error) {
	logger := klog.FromContext(ctx).WithValues("podUID", podUID)
	grace := r.Grace
	if grace <= 0 {
		grace = defaultStopGrace
	}
	ctrs, err := r.CRI.podContainers(ctx, podUID)
	if err != nil {
		a := Action{Op: opStopContainer, Path: "pod " + podUID, DryRun: r.DryRun, Err: err}
		return nil, []Action{a}, err
	}
	var actions []Action
	for _, name := range names {
		if !slices.ContainsFunc(ctrs, func(c Container) bool { return c.Name == name }) {
			actions = append(actions, Action{Op: opSkip, Path: "pod " + podUID, Detail: "container " + name + " is not running: nothing to stop"})
		}
	}
	var todo []Container
	for _, ct := range ctrs {
		if len(names) == 0 || slices.Contains(names, ct.Name) {
			todo = append(todo, ct)
		}
	}
	// All at once: each stop may take the whole grace period.
	acts := make([]Action, len(todo))
	done := make([]bool, len(todo))
	var wg sync.WaitGroup
	for i, ct := range todo {
		a := Action{Op: opStopContainer, Path: ct.ID, DryRun: r.DryRun,
			Detail: fmt.Sprintf("container %s of pod %s/%s (attempt %d), grace %s", ct.Name, ct.PodNamespace, ct.PodName, ct.Attempt, grace)}
		if r.DryRun {
			logger.V(2).Info("Would stop container", "container", ct.Name, "containerID", ct.ID)
			acts[i], done[i] = a, true
			continue
		}
		wg.Go(func() {
			start := time.Now()
			err := r.CRI.StopContainer(ctx, ct.ID, grace)
			a.Took = time.Since(start)
			switch {
			case status.Code(err) == codes.NotFound:
				a.Detail += ": already gone"
				done[i] = true
			case err != nil:
				a.Err = fmt.Errorf("stop container %s (%s): %w", ct.Name, ct.ID, err)
				logger.Error(err, "Stopping container failed", "container", ct.Name, "containerID", ct.ID)
			default:
				logger.V(2).Info("Stopped container for kubelet to restart", "container", ct.Name, "containerID", ct.ID)
				done[i] = true
			}
			acts[i] = a
		})
	}
	wg.Wait()
	var stopped []Container
	for i, ct := range todo {
		if done[i] {
			stopped = append(stopped, ct)
		}
	}
	actions = append(actions, acts...)
	return stopped, actions, actionsErr(actions)
}

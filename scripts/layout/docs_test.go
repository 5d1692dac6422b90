package layout

import (
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// repoRoot is the module's root, seen from this package's directory.
const repoRoot = "../.."

// repoURL is how the repository's own files are linked from places that
// need an absolute URL (the alerts' runbook_url): checked as relative links.
const repoURL = "https://github.com/mountmedic/mountmedic/blob/main/"

// processWords are words of the project's working process that have no
// place in reference docs, and the design brief the repository does not
// hold. Each names the fix in its failure.
var processWords = []struct {
	re  *regexp.Regexp
	fix string
	// absent: the pattern counts only while this file is not in the
	// repository.
	absent string
}{
	{regexp.MustCompile(`(?i)\bstop \d+\b`), "say what is true now; history belongs in git and CHANGELOG.md", ""},
	{regexp.MustCompile(`(?i)\bsession \d+\b`), "say what is true now; history belongs in git and CHANGELOG.md", ""},
	{regexp.MustCompile(`(?i)e2e node, stop`), "name the scenario and the command that measures it", ""},
	{regexp.MustCompile(`DESIGN\.md`), "DESIGN.md is not in the repository: cite a file that is", "DESIGN.md"},
}

// markdownFiles lists the repository's .md files, relative to its root.
func markdownFiles(t *testing.T) []string {
	t.Helper()
	var files []string
	err := filepath.WalkDir(repoRoot, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "testdata") {
			return filepath.SkipDir
		}
		if !d.IsDir() && strings.HasSuffix(d.Name(), ".md") {
			rel, err := filepath.Rel(repoRoot, path)
			if err != nil {
				return err
			}
			files = append(files, filepath.ToSlash(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(files, "README.md") {
		t.Fatalf("found no README.md under %s: %v", repoRoot, files)
	}
	return files
}

var (
	fence      = regexp.MustCompile("(?m)^\\s*(```|~~~)")
	inlineCode = regexp.MustCompile("`[^`\n]*`")
	// inlineLink matches [text](target) and ![alt](target "title").
	inlineLink = regexp.MustCompile(`\]\(\s*<?([^)\s>]+)>?(?:\s+"[^"]*")?\s*\)`)
	// refLink matches a reference definition: [label]: target
	refLink = regexp.MustCompile(`(?m)^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s|$)`)
	heading = regexp.MustCompile(`^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$`)
	htmlID  = regexp.MustCompile(`<a\s+(?:id|name)="([^"]+)"`)
)

// prose returns text without its fenced code blocks, and each line of
// prose without its code spans: what a reader sees as links and headings.
func prose(text string) []string {
	var out []string
	inFence := false
	for line := range strings.SplitSeq(text, "\n") {
		if fence.MatchString(line) {
			inFence = !inFence
			continue
		}
		if inFence {
			continue
		}
		out = append(out, inlineCode.ReplaceAllString(line, "``"))
	}
	return out
}

// slug is GitHub's anchor for a heading: markdown links reduced to their
// text, lower case, everything but letters, digits, spaces, hyphens and
// underscores dropped, spaces made hyphens.
func slug(title string) string {
	title = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`).ReplaceAllString(title, "$1")
	var b strings.Builder
	for _, r := range strings.ToLower(title) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// anchors returns the anchors a markdown file defines: its headings' slugs
// (a repeated one gets -1, -2, ... as on GitHub) and explicit <a id>s.
func anchors(text string) map[string]bool {
	out := make(map[string]bool)
	seen := make(map[string]int)
	inFence := false
	for line := range strings.SplitSeq(text, "\n") {
		if fence.MatchString(line) {
			inFence = !inFence
			continue
		}
		if inFence {
			continue
		}
		if m := heading.FindStringSubmatch(line); m != nil {
			s := slug(m[1])
			if n := seen[s]; n > 0 {
				out[fmt.Sprintf("%s-%d", s, n)] = true
			} else {
				out[s] = true
			}
			seen[s]++
		}
		for _, m := range htmlID.FindAllStringSubmatch(line, -1) {
			out[m[1]] = true
		}
	}
	return out
}

// checkLink checks one link target found in file (relative to the root): a
// relative path must exist, and a #fragment into a markdown file must be
// one of its anchors.
func checkLink(t *testing.T, file, target string, cache map[string]map[string]bool) {
	t.Helper()
	if rest, ok := strings.CutPrefix(target, repoURL); ok {
		target = "/" + rest
	} else if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
		return
	}
	path, frag, _ := strings.Cut(target, "#")
	var resolved string
	switch {
	case path == "":
		resolved = file
	case strings.HasPrefix(path, "/"):
		resolved = strings.TrimPrefix(path, "/")
	default:
		resolved = filepath.ToSlash(filepath.Join(filepath.Dir(file), path))
	}
	if strings.HasPrefix(resolved, "../") {
		t.Errorf("%s: link %q leaves the repository", file, target)
		return
	}
	st, err := os.Stat(filepath.Join(repoRoot, resolved))
	if err != nil {
		t.Errorf("%s: link %q: %s does not exist", file, target, resolved)
		return
	}
	if frag == "" || st.IsDir() || !strings.HasSuffix(resolved, ".md") {
		return
	}
	a, ok := cache[resolved]
	if !ok {
		b, err := os.ReadFile(filepath.Join(repoRoot, resolved))
		if err != nil {
			t.Fatal(err)
		}
		a = anchors(string(b))
		cache[resolved] = a
	}
	if !a[frag] {
		t.Errorf("%s: link %q: %s has no heading with anchor #%s", file, target, resolved, frag)
	}
}

// TestDocLinks: every relative link and #anchor between the repository's
// markdown files, and every link of deploy/'s manifests into the
// repository (runbook_url), leads to a file and heading that exist.
func TestDocLinks(t *testing.T) {
	cache := make(map[string]map[string]bool)
	links := 0
	for _, file := range markdownFiles(t) {
		b, err := os.ReadFile(filepath.Join(repoRoot, file))
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range prose(string(b)) {
			for _, m := range inlineLink.FindAllStringSubmatch(line, -1) {
				checkLink(t, file, m[1], cache)
				links++
			}
			for _, m := range refLink.FindAllStringSubmatch(line, -1) {
				checkLink(t, file, m[1], cache)
				links++
			}
		}
	}
	if links < 20 {
		t.Fatalf("found only %d links in the markdown files: is the link pattern broken?", links)
	}
	// The manifests link the docs by absolute URL (the alerts' runbook_url,
	// the dashboard's link to the runbooks).
	own := regexp.MustCompile(regexp.QuoteMeta(repoURL) + `[^\s"'),]+`)
	urls := 0
	err := filepath.WalkDir(filepath.Join(repoRoot, "deploy"), func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || !(strings.HasSuffix(path, ".yaml") || strings.HasSuffix(path, ".json")) {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(repoRoot, path)
		if err != nil {
			return err
		}
		for _, u := range own.FindAllString(string(b), -1) {
			checkLink(t, filepath.ToSlash(rel), u, cache)
			urls++
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if urls < 9 {
		t.Errorf("found %d links to %s in deploy/, want at least the 9 alerts' runbook_url", urls, repoURL)
	}
}

// TestDocsHaveNoProcessWords: the docs say what is true now, in words a
// reader outside the project understands.
func TestDocsHaveNoProcessWords(t *testing.T) {
	for _, file := range markdownFiles(t) {
		b, err := os.ReadFile(filepath.Join(repoRoot, file))
		if err != nil {
			t.Fatal(err)
		}
		for i, line := range strings.Split(string(b), "\n") {
			for _, w := range processWords {
				if w.absent != "" {
					if _, err := os.Stat(filepath.Join(repoRoot, w.absent)); err == nil {
						continue
					}
				}
				if m := w.re.FindString(line); m != "" {
					t.Errorf("%s:%d: %q: %s", file, i+1, m, w.fix)
				}
			}
		}
	}
}

// TestSlug pins the anchor rule the link check relies on to GitHub's.
func TestSlug(t *testing.T) {
	for in, want := range map[string]string{
		"MountmedicStaleMounts":                             "mountmedicstalemounts",
		"Set-up: two commands":                              "set-up-two-commands",
		"scan --mountinfo: a 10k-mount capture":             "scan---mountinfo-a-10k-mount-capture",
		"Cluster view: `mountmedic status`, `kubectl`":      "cluster-view-mountmedic-status-kubectl",
		"Failover (opt-in)":                                 "failover-opt-in",
		"[Unreleased](https://example.com)":                 "unreleased",
		"What a repair reads from the API server, and when": "what-a-repair-reads-from-the-api-server-and-when",
	} {
		if got := slug(in); got != want {
			t.Errorf("slug(%q) = %q, want %q", in, got, want)
		}
	}
	if got, want := anchors("# A\n## A\n```\n# not a heading\n```\n<a id=\"x\"></a>\n"), map[string]bool{"a": true, "a-1": true, "x": true}; !maps.Equal(got, want) {
		t.Errorf("anchors = %v, want %v", got, want)
	}
}

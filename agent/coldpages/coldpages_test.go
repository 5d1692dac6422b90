package coldpages

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	// What makes the agent's start-up touch most of its pages: client-go's
	// scheme registers every API type it links. The child's start-up
	// runs it, as the agent's does.
	_ "k8s.io/client-go/kubernetes/scheme"
)

const smaps = `00400000-01965000 r-xp 00000000 fe:00 10444898                           /usr/bin/mount medic
Size:              22432 kB
Rss:               14860 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me sd
01965000-031d0000 r--p 01565000 fe:00 10444898                           /usr/bin/mount medic
Rss:               14888 kB
Anonymous:             8 kB
031d0000-03269000 rw-p 02dd0000 fe:00 10444898                           /usr/bin/mount medic
Rss:                 548 kB
Anonymous:           100 kB
7ffd1000-7ffd3000 rw-p 00000000 00:00 0 
Rss:                   8 kB
Anonymous:             8 kB
`

func TestParseSmaps(t *testing.T) {
	got, err := ParseSmaps(strings.NewReader(smaps))
	if err != nil {
		t.Fatalf("ParseSmaps: %v", err)
	}
	want := []Mapping{
		{Start: 0x400000, End: 0x1965000, Perms: "r-xp", Major: 0xfe, Inode: 10444898, Path: "/usr/bin/mount medic", Rss: 14860 << 10},
		{Start: 0x1965000, End: 0x31d0000, Perms: "r--p", Major: 0xfe, Inode: 10444898, Path: "/usr/bin/mount medic", Rss: 14888 << 10, Anonymous: 8 << 10},
		{Start: 0x31d0000, End: 0x3269000, Perms: "rw-p", Major: 0xfe, Inode: 10444898, Path: "/usr/bin/mount medic", Rss: 548 << 10, Anonymous: 100 << 10},
		{Start: 0x7ffd1000, End: 0x7ffd3000, Perms: "rw-p", Rss: 8 << 10, Anonymous: 8 << 10},
	}
	if len(got) != len(want) {
		t.Fatalf("ParseSmaps = %d mappings %+v, want %d", len(got), got, len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("ParseSmaps mapping %d = %+v, want %+v", i, got[i], want[i])
		}
	}
	// Only the text: the read-only data holds a written page, the data
	// segment is writable.
	for i, cold := range []bool{true, false, false, false} {
		if got[i].cold() != cold {
			t.Errorf("mapping %d (%s, %d anonymous) cold() = %v, want %v", i, got[i].Perms, got[i].Anonymous, got[i].cold(), cold)
		}
	}
}

func TestParseSmapsNamesTheBadLine(t *testing.T) {
	for name, in := range map[string]string{
		"short header": "00400000-01965000 r-xp 00000000\n",
		"bad device":   "00400000-01965000 r-xp 00000000 fe00 1 /x\n",
		"bad size":     "00400000-01965000 r-xp 00000000 fe:00 1 /x\nRss: 12 MB\n",
	} {
		t.Run(name, func(t *testing.T) {
			_, err := ParseSmaps(strings.NewReader(in))
			if err == nil || !strings.Contains(err.Error(), "smaps line") {
				t.Errorf("ParseSmaps(%q) = %v, want an error naming the line", in, err)
			}
		})
	}
}

// exeResident is the resident size of the private read-only mappings of
// process pid's executable without written pages, the ones Release gives
// back.
func exeResident(t *testing.T, pid int) int64 {
	t.Helper()
	proc := "/proc/" + strconv.Itoa(pid)
	var st unix.Stat_t
	if err := unix.Stat(proc+"/exe", &st); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(proc + "/smaps")
	if err != nil {
		t.Fatal(err)
	}
	maps, err := ParseSmaps(bytes.NewReader(data))
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for _, m := range maps {
		if m.of(&st) && m.cold() {
			n += m.Rss
		}
	}
	return n
}

const childEnv = "MOUNTMEDIC_COLDPAGES_CHILD"

// The test binary, run again as a child: it releases when its parent
// writes a line, says so, and then waits, touching nothing, for its parent
// to read its memory.
func TestReleaseGivesBackTheExecutablesPages(t *testing.T) {
	if os.Getenv(childEnv) == "1" {
		in := bufio.NewReader(os.Stdin)
		fmt.Println("ready")
		in.ReadString('\n')
		res, err := Release()
		fmt.Printf("%d %d %v\n", res.Advised, res.Skipped, err)
		in.ReadString('\n')
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestReleaseGivesBackTheExecutablesPages$")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		stdin.Close()
		cmd.Wait()
	}()
	out := bufio.NewReader(stdout)
	if line, err := out.ReadString('\n'); err != nil || line != "ready\n" {
		t.Fatalf("child: %q, %v", line, err)
	}
	before := exeResident(t, cmd.Process.Pid)
	if before < 1<<20 {
		t.Fatalf("the child has %d bytes of its code resident: too little to tell a release", before)
	}
	fmt.Fprintln(stdin, "release")
	line, err := out.ReadString('\n')
	if err != nil {
		t.Fatalf("child: %v", err)
	}
	after := exeResident(t, cmd.Process.Pid)
	t.Logf("child: release said %q; its resident code %d kB -> %d kB", strings.TrimSpace(line), before>>10, after>>10)
	if f := strings.Fields(line); len(f) < 3 || f[0] == "0" || f[2] != "<nil>" {
		t.Errorf("child's Release = %q, want mappings advised and no error", line)
	}
	// What the child ran after the release is mapped back; the rest
	// of what it had touched is not.
	if after > before/4 {
		t.Errorf("child's resident code after Release = %d kB, want under a quarter of %d kB", after>>10, before>>10)
	}
}

// A page the process wrote in a private mapping that is read-only now (a
// position-independent binary's relocated data) would be lost to
// MADV_DONTNEED: such a mapping is never advised.
func TestReleaseKeepsWrittenPages(t *testing.T) {
	path := filepath.Join(t.TempDir(), "data")
	if err := os.WriteFile(path, bytes.Repeat([]byte{'f'}, 2*os.Getpagesize()), 0o600); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// Two mappings of the file: one written (then read-only), one read.
	written, err := unix.Mmap(int(f.Fd()), 0, os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(written)
	written[0] = 'w'
	if err := unix.Mprotect(written, unix.PROT_READ); err != nil {
		t.Fatal(err)
	}
	read, err := unix.Mmap(int(f.Fd()), int64(os.Getpagesize()), os.Getpagesize(), unix.PROT_READ, unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(read)
	_ = read[0]

	res, err := releaseFile(path)
	if err != nil {
		t.Fatalf("releaseFile: %v", err)
	}
	if res.Advised != 1 || res.Skipped != 1 {
		t.Errorf("releaseFile = %+v, want the read mapping advised and the written one skipped", res)
	}
	if written[0] != 'w' {
		t.Errorf("the written page reads %q after releaseFile, want 'w': the write was lost", written[0])
	}
	if read[0] != 'f' {
		t.Errorf("the advised page reads %q, want 'f' from the file", read[0])
	}
}

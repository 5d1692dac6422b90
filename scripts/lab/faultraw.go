package lab

import (
	"sync"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// faults is the fault state of the FUSE daemon, set over its control socket.
type faults struct {
	mu    sync.Mutex
	errno syscall.Errno
	hang  chan struct{} // non-nil while hung; closed by release
	// delay makes every answer this late: a slow daemon, not a hung one.
	delay time.Duration
}

func (f *faults) setDelay(d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.delay = d
}

func (f *faults) setErrno(e syscall.Errno) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.errno = e
}

func (f *faults) startHang() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.hang == nil {
		f.hang = make(chan struct{})
	}
}

func (f *faults) release() {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.hang != nil {
		close(f.hang)
		f.hang = nil
	}
}

// check blocks while the filesystem hangs, then answers the injected errno
// (fuse.OK when none). A hung handler ignores the kernel's INTERRUPT on
// purpose, like a daemon stuck in its backend: only a release or an abort of
// the connection ends the call.
func (f *faults) check() fuse.Status {
	f.mu.Lock()
	hang, delay := f.hang, f.delay
	f.mu.Unlock()
	time.Sleep(delay)
	if hang != nil {
		<-hang
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.errno != 0 {
		return fuse.Status(f.errno)
	}
	return fuse.OK
}

// faultRaw puts the fault state in front of every request of a go-fuse
// filesystem that has an answer: lookups, attributes (GETATTR, STATX),
// STATFS, data, directories, xattrs, locks. Init, Forget, Release and
// ReleaseDir pass through so that mounting and closing files keep working.
type faultRaw struct {
	fuse.RawFileSystem
	f *faults
}

var _ fuse.RawFileSystem = (*faultRaw)(nil)

func (r *faultRaw) Lookup(cancel <-chan struct{}, header *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Lookup(cancel, header, name, out)
}

func (r *faultRaw) GetAttr(cancel <-chan struct{}, input *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.GetAttr(cancel, input, out)
}

func (r *faultRaw) SetAttr(cancel <-chan struct{}, input *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.SetAttr(cancel, input, out)
}

func (r *faultRaw) Statx(cancel <-chan struct{}, input *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Statx(cancel, input, out)
}

func (r *faultRaw) StatFs(cancel <-chan struct{}, input *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.StatFs(cancel, input, out)
}

func (r *faultRaw) Mknod(cancel <-chan struct{}, input *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Mknod(cancel, input, name, out)
}

func (r *faultRaw) Mkdir(cancel <-chan struct{}, input *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Mkdir(cancel, input, name, out)
}

func (r *faultRaw) Unlink(cancel <-chan struct{}, header *fuse.InHeader, name string) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Unlink(cancel, header, name)
}

func (r *faultRaw) Rmdir(cancel <-chan struct{}, header *fuse.InHeader, name string) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Rmdir(cancel, header, name)
}

func (r *faultRaw) Rename(cancel <-chan struct{}, input *fuse.RenameIn, oldName string, newName string) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Rename(cancel, input, oldName, newName)
}

func (r *faultRaw) Link(cancel <-chan struct{}, input *fuse.LinkIn, filename string, out *fuse.EntryOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Link(cancel, input, filename, out)
}

func (r *faultRaw) Symlink(cancel <-chan struct{}, header *fuse.InHeader, pointedTo string, linkName string, out *fuse.EntryOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Symlink(cancel, header, pointedTo, linkName, out)
}

func (r *faultRaw) Readlink(cancel <-chan struct{}, header *fuse.InHeader) ([]byte, fuse.Status) {
	if st := r.f.check(); !st.Ok() {
		return nil, st
	}
	return r.RawFileSystem.Readlink(cancel, header)
}

func (r *faultRaw) Access(cancel <-chan struct{}, input *fuse.AccessIn) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Access(cancel, input)
}

func (r *faultRaw) GetXAttr(cancel <-chan struct{}, header *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	if st := r.f.check(); !st.Ok() {
		return 0, st
	}
	return r.RawFileSystem.GetXAttr(cancel, header, attr, dest)
}

func (r *faultRaw) ListXAttr(cancel <-chan struct{}, header *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	if st := r.f.check(); !st.Ok() {
		return 0, st
	}
	return r.RawFileSystem.ListXAttr(cancel, header, dest)
}

func (r *faultRaw) SetXAttr(cancel <-chan struct{}, input *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.SetXAttr(cancel, input, attr, data)
}

func (r *faultRaw) RemoveXAttr(cancel <-chan struct{}, header *fuse.InHeader, attr string) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.RemoveXAttr(cancel, header, attr)
}

func (r *faultRaw) Create(cancel <-chan struct{}, input *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Create(cancel, input, name, out)
}

func (r *faultRaw) Tmpfile(cancel <-chan struct{}, input *fuse.CreateIn, out *fuse.CreateOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Tmpfile(cancel, input, out)
}

func (r *faultRaw) Open(cancel <-chan struct{}, input *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Open(cancel, input, out)
}

func (r *faultRaw) Read(cancel <-chan struct{}, input *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	if st := r.f.check(); !st.Ok() {
		return nil, st
	}
	return r.RawFileSystem.Read(cancel, input, buf)
}

func (r *faultRaw) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Lseek(cancel, in, out)
}

func (r *faultRaw) GetLk(cancel <-chan struct{}, input *fuse.LkIn, out *fuse.LkOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.GetLk(cancel, input, out)
}

func (r *faultRaw) SetLk(cancel <-chan struct{}, input *fuse.LkIn) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.SetLk(cancel, input)
}

func (r *faultRaw) SetLkw(cancel <-chan struct{}, input *fuse.LkIn) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.SetLkw(cancel, input)
}

func (r *faultRaw) Write(cancel <-chan struct{}, input *fuse.WriteIn, data []byte) (uint32, fuse.Status) {
	if st := r.f.check(); !st.Ok() {
		return 0, st
	}
	return r.RawFileSystem.Write(cancel, input, data)
}

func (r *faultRaw) Writev(cancel <-chan struct{}, input *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	if st := r.f.check(); !st.Ok() {
		return 0, st
	}
	return r.RawFileSystem.Writev(cancel, input, data)
}

func (r *faultRaw) CopyFileRange(cancel <-chan struct{}, input *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	if st := r.f.check(); !st.Ok() {
		return 0, st
	}
	return r.RawFileSystem.CopyFileRange(cancel, input)
}

func (r *faultRaw) Ioctl(cancel <-chan struct{}, input *fuse.IoctlIn, inbuf []byte, output *fuse.IoctlOut, outbuf []byte) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Ioctl(cancel, input, inbuf, output, outbuf)
}

func (r *faultRaw) Flush(cancel <-chan struct{}, input *fuse.FlushIn) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Flush(cancel, input)
}

func (r *faultRaw) Fsync(cancel <-chan struct{}, input *fuse.FsyncIn) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Fsync(cancel, input)
}

func (r *faultRaw) Fallocate(cancel <-chan struct{}, input *fuse.FallocateIn) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.Fallocate(cancel, input)
}

func (r *faultRaw) OpenDir(cancel <-chan struct{}, input *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.OpenDir(cancel, input, out)
}

func (r *faultRaw) ReadDir(cancel <-chan struct{}, input *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.ReadDir(cancel, input, out)
}

func (r *faultRaw) ReadDirPlus(cancel <-chan struct{}, input *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.ReadDirPlus(cancel, input, out)
}

func (r *faultRaw) FsyncDir(cancel <-chan struct{}, input *fuse.FsyncIn) fuse.Status {
	if st := r.f.check(); !st.Ok() {
		return st
	}
	return r.RawFileSystem.FsyncDir(cancel, input)
}

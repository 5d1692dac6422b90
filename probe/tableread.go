package probe

import (
	"context"
	"sync"
)

// TableReader is the one reader of a mount table in a process: the agent's
// loop, the repairs that read the whole table (kernels without statmount)
// and the stall watch share its reads. A caller never gets a read that
// began before it asked (it may have just changed a mount and must see
// it): while a read runs, askers queue for the next one, which starts when
// the running one ends and serves them all. A burst of asks costs at most
// two reads in a row, however many callers ask.
type TableReader struct {
	path string
	opts Options

	mu      sync.Mutex
	running *tableRead // the read under way, if any
	next    *tableRead // the read to start once running ends; joinable
	last    *Inventory // the newest read that succeeded
	// read is ReadTable; a seam for tests.
	read func(ctx context.Context, path string, opts Options) (*Inventory, error)
}

type tableRead struct {
	done chan struct{}
	inv  *Inventory
	err  error
}

// NewTableReader reads the mount table at path (see ReadTable) with opts.
func NewTableReader(path string, opts Options) *TableReader {
	return &TableReader{path: path, opts: opts, read: ReadTable}
}

// SetDriverStages sets Options.DriverStages for the reads that start
// after it: the agent's cache of driver capabilities, which exists only
// once the agent does.
func (t *TableReader) SetDriverStages(f func(driver string) (stages, known bool)) {
	t.mu.Lock()
	t.opts.DriverStages = f
	t.mu.Unlock()
}

// Path is the table's path.
func (t *TableReader) Path() string { return t.path }

// Root is the kubelet root the table is classified under.
func (t *TableReader) Root() string {
	if t.opts.Root == "" {
		return DefaultKubeletRoot
	}
	return t.opts.Root
}

// Last is the newest table read, nil before the first.
func (t *TableReader) Last() *Inventory {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.last
}

// Read returns a read of the table that began after the call: its own, or
// one it shares with callers that asked while the one before ran. The read
// runs on the goroutine of the first caller that asked for it, so a
// /proc/thread-self table is that goroutine's thread's.
func (t *TableReader) Read(ctx context.Context) (*Inventory, error) {
	t.mu.Lock()
	if rd := t.next; rd != nil {
		t.mu.Unlock()
		select {
		case <-rd.done:
			return rd.inv, rd.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	rd := &tableRead{done: make(chan struct{})}
	prev := t.running
	if prev == nil {
		t.running = rd
	} else {
		t.next = rd
	}
	t.mu.Unlock()
	if prev != nil {
		// This caller reads next, for every caller that joins it; it waits
		// for the running read whatever its own ctx says, so that those
		// callers are served.
		<-prev.done
		t.mu.Lock()
		t.next, t.running = nil, rd
		t.mu.Unlock()
	}
	// The read serves other callers too: it is not cut short by the first
	// caller's context.
	t.mu.Lock()
	opts := t.opts
	t.mu.Unlock()
	rd.inv, rd.err = t.read(context.WithoutCancel(ctx), t.path, opts)
	t.mu.Lock()
	if t.running == rd {
		t.running = nil
	}
	if rd.err == nil {
		t.last = rd.inv
	}
	t.mu.Unlock()
	close(rd.done)
	return rd.inv, rd.err
}

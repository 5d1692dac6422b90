package agent

import (
	"container/list"
	"sync"
	"time"
)

// objectCache is a bounded cache of API objects with a freshness TTL. A
// fresh entry is served without asking the API server; a stale one only when
// the API server cannot be reached. The least recently used entry goes when
// the cache is full. It never holds Secrets.
type objectCache struct {
	mu    sync.Mutex
	size  int
	ttl   time.Duration
	now   func() time.Time
	ll    *list.List
	items map[string]*list.Element
}

type cacheEntry struct {
	key    string
	obj    any
	stored time.Time
}

func newObjectCache(size int, ttl time.Duration, now func() time.Time) *objectCache {
	if now == nil {
		now = time.Now
	}
	return &objectCache{size: size, ttl: ttl, now: now, ll: list.New(), items: make(map[string]*list.Element)}
}

// get returns the object under key and whether it is still fresh.
func (c *objectCache) get(key string) (obj any, fresh, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	el, ok := c.items[key]
	if !ok {
		return nil, false, false
	}
	c.ll.MoveToFront(el)
	e := el.Value.(*cacheEntry)
	return e.obj, c.now().Sub(e.stored) < c.ttl, true
}

func (c *objectCache) put(key string, obj any) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.items[key]; ok {
		e := el.Value.(*cacheEntry)
		e.obj, e.stored = obj, c.now()
		c.ll.MoveToFront(el)
		return
	}
	c.items[key] = c.ll.PushFront(&cacheEntry{key: key, obj: obj, stored: c.now()})
	for c.ll.Len() > c.size {
		last := c.ll.Back()
		c.ll.Remove(last)
		delete(c.items, last.Value.(*cacheEntry).key)
	}
}

func (c *objectCache) remove(key string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.items[key]; ok {
		c.ll.Remove(el)
		delete(c.items, key)
	}
}

func (c *objectCache) len() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.ll.Len()
}

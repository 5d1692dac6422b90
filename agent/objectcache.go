package agent

import (
	"time"

	"k8s.io/utils/lru"
)

// objectCache is a bounded cache of API objects with a freshness TTL. A
// fresh entry is served without asking the API server; a stale one only when
// the API server cannot be reached (cachedGet decides). The least recently
// used entry goes when the cache is full. It never holds Secrets.
type objectCache struct {
	lru *lru.Cache // key -> cacheEntry; safe for concurrent use
	ttl time.Duration
	now func() time.Time
}

type cacheEntry struct {
	obj    any
	stored time.Time
}

func newObjectCache(size int, ttl time.Duration, now func() time.Time) *objectCache {
	if now == nil {
		now = time.Now
	}
	return &objectCache{lru: lru.New(size), ttl: ttl, now: now}
}

// get returns the object under key and whether it is still fresh.
func (c *objectCache) get(key string) (obj any, fresh, ok bool) {
	v, ok := c.lru.Get(key)
	if !ok {
		return nil, false, false
	}
	e := v.(cacheEntry)
	return e.obj, c.now().Sub(e.stored) < c.ttl, true
}

func (c *objectCache) put(key string, obj any) {
	c.lru.Add(key, cacheEntry{obj: obj, stored: c.now()})
}

func (c *objectCache) remove(key string) {
	c.lru.Remove(key)
}

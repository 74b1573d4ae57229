//! The in-process tier: least recently used entries go first once the bytes charged exceed the
//! bound.
use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use super::{Cached, Key};

pub struct Lru {
    capacity: usize,
    used: usize,
    tick: u64,
    entries: HashMap<Key, (Arc<Cached>, usize, u64)>,
    /// Last use → key, oldest first.
    order: BTreeMap<u64, Key>,
}

impl Lru {
    pub fn new(capacity: usize) -> Self {
        Lru { capacity, used: 0, tick: 0, entries: HashMap::new(), order: BTreeMap::new() }
    }

    pub fn get(&mut self, key: &Key) -> Option<Arc<Cached>> {
        self.tick += 1;
        let (value, _, last) = self.entries.get_mut(key)?;
        self.order.remove(last);
        *last = self.tick;
        self.order.insert(self.tick, *key);
        Some(Arc::clone(value))
    }

    /// Stores `value` charged `bytes`; an entry larger than the whole bound is not kept.
    pub fn put(&mut self, key: Key, value: Arc<Cached>, bytes: usize) {
        if bytes > self.capacity {
            return;
        }
        if let Some((_, old, last)) = self.entries.remove(&key) {
            self.used -= old;
            self.order.remove(&last);
        }
        while self.used + bytes > self.capacity {
            let Some((_, oldest)) = self.order.pop_first() else { break };
            if let Some((_, b, _)) = self.entries.remove(&oldest) {
                self.used -= b;
            }
        }
        self.tick += 1;
        self.used += bytes;
        self.entries.insert(key, (value, bytes, self.tick));
        self.order.insert(self.tick, key);
    }

    /// (entries, bytes charged, the bound)
    pub fn usage(&self) -> (usize, usize, usize) {
        (self.entries.len(), self.used, self.capacity)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v() -> Arc<Cached> {
        Arc::new(Cached { parameters: Default::default(), outputs: vec![] })
    }

    #[test]
    fn evicts_the_least_recently_used_within_the_bound() {
        let mut l = Lru::new(300);
        l.put([1; 32], v(), 100);
        l.put([2; 32], v(), 100);
        l.put([3; 32], v(), 100);
        assert!(l.get(&[1; 32]).is_some());
        l.put([4; 32], v(), 100);
        assert!(l.get(&[2; 32]).is_none(), "2 was the least recently used");
        assert!(l.get(&[1; 32]).is_some() && l.get(&[3; 32]).is_some() && l.get(&[4; 32]).is_some());
        assert_eq!(l.usage(), (3, 300, 300));
        l.put([5; 32], v(), 250);
        assert_eq!(l.usage(), (1, 250, 300));
        l.put([6; 32], v(), 301);
        assert!(l.get(&[6; 32]).is_none(), "larger than the bound: not kept");
        assert_eq!(l.usage(), (1, 250, 300));
    }

    #[test]
    fn replacing_a_key_recharges_it() {
        let mut l = Lru::new(300);
        l.put([1; 32], v(), 100);
        l.put([1; 32], v(), 200);
        assert_eq!(l.usage(), (1, 200, 300));
    }
}

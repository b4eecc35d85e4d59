//! A shard's table of one quota: slots packed in a vector, found through a
//! hash index of 4-byte positions.
//!
//! A hash table keeps 1/8 to 1/2 of its buckets empty, and a bucket is as
//! large as what it holds: here that is 4 bytes plus a control byte, while
//! the slots themselves take exactly one place each (the vector's unused
//! capacity is never written, so it costs address space, not memory).

use hashbrown::HashTable;

use std::sync::Arc;

use super::key::StoredKey;

/// What a table holds.
pub(super) trait Keyed {
    fn key(&self) -> &StoredKey;
}

#[derive(Debug)]
pub(super) struct Table<E> {
    index: HashTable<u32>,
    slots: Vec<E>,
}

impl<E> Default for Table<E> {
    fn default() -> Self {
        Table {
            index: HashTable::new(),
            slots: Vec::new(),
        }
    }
}

impl<E: Keyed> Table<E> {
    /// True when another slot fits: positions are 4 bytes.
    pub(super) fn has_room(&self) -> bool {
        self.slots.len() < u32::MAX as usize
    }

    #[inline]
    pub(super) fn find_mut(&mut self, hash: u64, key: &Arc<str>) -> Option<&mut E> {
        let slots = &self.slots;
        let at = *self.index.find(hash, |&i| {
            slots
                .get(i as usize)
                .is_some_and(|slot| slot.key().matches(key))
        })?;
        self.slots.get_mut(at as usize)
    }

    /// Adds a slot for a key the table does not hold (and [`has_room`](Self::has_room));
    /// `rehash` gives a held slot's hash.
    pub(super) fn insert(&mut self, hash: u64, slot: E, rehash: impl Fn(&E) -> u64) {
        let at = self.slots.len() as u32;
        self.slots.push(slot);
        let slots = &self.slots;
        self.index
            .insert_unique(hash, at, |&i| rehash(&slots[i as usize]));
    }

    /// Keeps the slots for which `keep` holds; returns how many it dropped.
    /// Each dropped slot costs two hashes (its own and the one moved into
    /// its place), unless more than a third are dropped: then the index is
    /// rebuilt, one hash per slot kept.
    pub(super) fn retain(
        &mut self,
        keep: impl FnMut(&E) -> bool,
        rehash: impl Fn(&E) -> u64,
    ) -> usize {
        let live: Vec<bool> = self.slots.iter().map(keep).collect();
        let dropped = live.iter().filter(|live| !**live).count();
        if dropped * 3 > self.slots.len() {
            let mut live = live.into_iter();
            self.slots.retain(|_| live.next().unwrap_or(true));
            self.slots.shrink_to(self.slots.len() * 2);
            let slots = &self.slots;
            self.index = HashTable::with_capacity(slots.len());
            for (i, slot) in slots.iter().enumerate() {
                self.index
                    .insert_unique(rehash(slot), i as u32, |&j| rehash(&slots[j as usize]));
            }
            return dropped;
        }
        // From the back, so the slot moved into a dropped one's place has
        // already been kept.
        for (at, live) in live.iter().enumerate().rev() {
            if !live {
                self.remove(at, &rehash);
            }
        }
        dropped
    }

    /// Drops the slot at `at`, moving the last slot into its place.
    fn remove(&mut self, at: usize, rehash: &impl Fn(&E) -> u64) {
        let position = |at: usize| move |&i: &u32| i as usize == at;
        if let Ok(entry) = self.index.find_entry(rehash(&self.slots[at]), position(at)) {
            entry.remove();
        }
        let last = self.slots.len() - 1;
        self.slots.swap_remove(at);
        if at != last {
            if let Some(i) = self.index.find_mut(rehash(&self.slots[at]), position(last)) {
                *i = at as u32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::{BuildHasher, RandomState};

    #[derive(Debug)]
    struct Numbered {
        key: StoredKey,
        n: usize,
    }

    impl Keyed for Numbered {
        fn key(&self) -> &StoredKey {
            &self.key
        }
    }

    fn key(n: usize) -> Arc<str> {
        // Short keys inline, every seventh one long and shared.
        if n.is_multiple_of(7) {
            format!("a-long-key-that-is-not-inline-{n}").into()
        } else {
            format!("k{n}").into()
        }
    }

    #[test]
    fn retain_keeps_exactly_the_kept_slots_findable() {
        let hasher = RandomState::new();
        let rehash = |e: &Numbered| hasher.hash_one(e.key.bytes());
        // Dropping few (one slot at a time) and dropping most (a rebuild).
        for drop_every in [10, 2, 1] {
            let mut table = Table::default();
            for n in 0..1000 {
                let k = key(n);
                let slot = Numbered {
                    key: StoredKey::new(&k),
                    n,
                };
                table.insert(hasher.hash_one(k.as_bytes()), slot, rehash);
            }
            let kept =
                |n: usize| !n.is_multiple_of(drop_every) || drop_every == 1 && n.is_multiple_of(3);
            let dropped = table.retain(|e| kept(e.n), rehash);
            assert_eq!(dropped, (0..1000).filter(|&n| !kept(n)).count());
            for n in 0..1000 {
                let k = key(n);
                let found = table
                    .find_mut(hasher.hash_one(k.as_bytes()), &k)
                    .map(|e| e.n);
                assert_eq!(
                    found,
                    kept(n).then_some(n),
                    "key {n}, 1 in {drop_every} dropped"
                );
            }
        }
    }
}

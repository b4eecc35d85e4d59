//! The shards of a [`MemoryStore`](super::MemoryStore): its keys' tables, one per quota layout,
//! under one lock each.

use ahash::RandomState;

use super::slots::droppable_at;
use super::slots::{Entry, Kind};
use super::table::Table;

/// A key hashed as its bytes in one write.
pub(super) struct KeyBytes<'a>(&'a [u8]);

impl std::hash::Hash for KeyBytes<'_> {
    #[inline]
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write(self.0);
    }
}

/// The store's keyed hash of a key's bytes, mixed with the quota
/// [layout](crate::quota::Quota::layout) hash: one hasher pass per decision. The hash is
/// aHash under random keys drawn for each store, so a client cannot choose
/// keys that collide in its tables.
#[inline]
pub(super) fn key_hash(hasher: &RandomState, layout: u64, key: &[u8]) -> u64 {
    hasher.hash_one(KeyBytes(key)) ^ layout
}

/// Keeps each shard on its own cache lines, so threads working on
/// different shards do not contend.
#[derive(Debug)]
#[repr(align(128))]
pub(super) struct Padded<T>(pub(super) T);

#[derive(Debug, Default)]
pub(super) struct Shard {
    /// The keys of each quota layout met in this shard, one table each;
    /// the first inline, on the lock's cache lines.
    tables: smallvec::SmallVec<[Tables; 1]>,
    /// No key can be dropped before this time, even by a full store: a
    /// lower bound of every key's [`droppable_at`].
    pub(super) next_expiry: u64,
}

/// A shard's keys of one quota layout, in the slot type of the quota's
/// shape: a layout hash fixes the policies' algorithm kinds.
#[derive(Debug)]
pub(super) struct Tables {
    layout: u64,
    /// Every policy of the quota that last decided here is a shadow: the
    /// keys hold no state that refuses, and a full store may drop them.
    shadow_only: bool,
    kind: Kind,
}

/// What a sweep drops.
#[derive(Debug, Clone, Copy)]
pub(super) enum Sweep {
    /// Keys whose every state is equivalent to fresh: losing them loses
    /// nothing.
    Fresh,
    /// Also, for a full store, keys whose enforcing states are: a shadow
    /// policy's state is dropped with them and starts fresh.
    Full,
}

/// Applies `$body` to the table, whatever its slot type.
macro_rules! each_table {
    ($kind:expr, |$t:ident| $body:expr) => {
        match $kind {
            Kind::Bucket($t) => $body,
            Kind::FixedWindow($t) => $body,
            Kind::SlidingWindow($t) => $body,
            Kind::SlidingLog($t) => $body,
            Kind::General($t) => $body,
        }
    };
}

impl Shard {
    /// The table of `layout` in slot type `E`, if this shard has one,
    /// noting whether its quota is now `shadow_only`.
    #[inline]
    pub(super) fn table<E: Entry>(
        &mut self,
        layout: u64,
        shadow_only: bool,
    ) -> Option<&mut Table<E>> {
        self.tables.iter_mut().find_map(|t| {
            if t.layout != layout {
                return None;
            }
            if t.shadow_only != shadow_only {
                t.shadow_only = shadow_only;
            }
            E::table(&mut t.kind)
        })
    }

    pub(super) fn table_or_new<E: Entry>(
        &mut self,
        layout: u64,
        shadow_only: bool,
    ) -> &mut Table<E> {
        let at = self
            .tables
            .iter_mut()
            .position(|t| t.layout == layout && E::table(&mut t.kind).is_some());
        let at = at.unwrap_or_else(|| {
            self.tables.push(Tables {
                layout,
                shadow_only,
                kind: E::new_table(),
            });
            self.tables.len() - 1
        });
        let tables = &mut self.tables[at];
        tables.shadow_only = shadow_only;
        let table = E::table(&mut tables.kind);
        table.expect("the table of this layout and slot type")
    }

    /// Drops the keys that `sweep` may drop at `now`; returns how many.
    pub(super) fn sweep(&mut self, now: u64, hasher: &RandomState, sweep: Sweep) -> usize {
        fn retain_live<E: Entry>(
            table: &mut Table<E>,
            (layout, shadow_only): (u64, bool),
            now: u64,
            sweep: Sweep,
            next: &mut u64,
            hasher: &RandomState,
        ) -> usize {
            table.retain(
                |e| {
                    let droppable = droppable_at(e, shadow_only);
                    let live = match sweep {
                        Sweep::Fresh => e.fresh_at() > now,
                        Sweep::Full => droppable > now,
                    };
                    if live {
                        *next = (*next).min(droppable);
                    }
                    live
                },
                |e| key_hash(hasher, layout, e.key().bytes()),
            )
        }
        let mut next = u64::MAX;
        let mut swept = 0;
        for t in &mut self.tables {
            let table = (t.layout, t.shadow_only);
            swept += each_table!(&mut t.kind, |kind| retain_live(
                kind, table, now, sweep, &mut next, hasher
            ));
        }
        self.next_expiry = next;
        swept
    }
}

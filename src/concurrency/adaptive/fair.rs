//! One class's wait queue, fair across tenants: a sub-queue per tenant,
//! served round-robin, each holding at most `queue / tenants waiting`.

use std::collections::VecDeque;
use std::sync::Arc;

use ahash::RandomState;
use hashbrown::HashMap;
use tokio::sync::oneshot;
use tokio::time::Instant;

/// What a waiter is handed.
#[derive(Debug)]
pub(super) enum Admit {
    /// A slot, taken for it at `at` under probe `epoch`.
    Go { at: Instant, epoch: u64 },
    /// Pushed out of the queue for a tenant under its fair share.
    Evicted,
}

/// Why [`FairQueue::push`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Full {
    /// The class's queue is full of tenants at or under their share.
    Queue,
    /// The tenant holds its fair share of the queue already.
    Tenant,
}

/// One tenant's waiters, in arrival order. A waiter that left keeps its
/// closed sender here until it is skipped or swept.
#[derive(Debug, Default)]
struct Tenant {
    waiters: VecDeque<oneshot::Sender<Admit>>,
    live: usize,
}

#[derive(Debug, Default)]
pub(super) struct FairQueue {
    /// Tenants with a waiter still waiting.
    tenants: HashMap<Arc<str>, Tenant, RandomState>,
    /// The same tenants, in the order they are served.
    order: VecDeque<Arc<str>>,
    live: usize,
}

impl FairQueue {
    /// Waiters still waiting.
    pub(super) fn live(&self) -> usize {
        self.live
    }

    /// Queues a waiter of `tenant`, within `queue` places for the class and
    /// `queue / tenants waiting` (at least 1) for the tenant. A tenant under
    /// its share that finds the queue full pushes out the newest waiter of
    /// the tenant with the most.
    pub(super) fn push(
        &mut self,
        tenant: &Arc<str>,
        queue: usize,
    ) -> Result<oneshot::Receiver<Admit>, Full> {
        let known = self.tenants.get(tenant).map(|t| t.live);
        let waiting = self.tenants.len() + usize::from(known.is_none());
        let share = (queue / waiting).max(1);
        if known.unwrap_or(0) >= share {
            return Err(Full::Tenant);
        }
        if self.live >= queue && !self.evict_from_largest() {
            return Err(Full::Queue);
        }
        if known.is_none() {
            self.order.push_back(Arc::clone(tenant));
        }
        let entry = self.tenants.entry(Arc::clone(tenant)).or_default();
        // Senders of waiters that left: swept once they are as many as the
        // live ones.
        if entry.waiters.len() > 2 * entry.live {
            entry.waiters.retain(|tx| !tx.is_closed());
        }
        let (tx, rx) = oneshot::channel();
        entry.waiters.push_back(tx);
        entry.live += 1;
        self.live += 1;
        Ok(rx)
    }

    /// Hands `admit` to the next waiter, round-robin across tenants. False
    /// when none waits.
    pub(super) fn next(&mut self, at: Instant, epoch: u64) -> bool {
        // Each tenant once at most: one whose waiters all left, but have
        // not yet said so, has no sender to hand to.
        for _ in 0..self.order.len() {
            let Some(key) = self.order.pop_front() else {
                break;
            };
            let Some(tenant) = self.tenants.get_mut(&key) else {
                continue;
            };
            let mut handed = false;
            while let Some(tx) = tenant.waiters.pop_front() {
                if tx.send(Admit::Go { at, epoch }).is_ok() {
                    tenant.live -= 1;
                    self.live -= 1;
                    handed = true;
                    break;
                }
            }
            if tenant.live > 0 {
                self.order.push_back(key);
            } else {
                self.tenants.remove(&key);
            }
            if handed {
                return true;
            }
        }
        false
    }

    /// A waiter of `tenant` left without being handed anything.
    pub(super) fn leave(&mut self, tenant: &Arc<str>) {
        let Some(entry) = self.tenants.get_mut(tenant) else {
            return;
        };
        entry.live -= 1;
        self.live -= 1;
        if entry.live == 0 {
            self.tenants.remove(tenant);
            self.order.retain(|k| k != tenant);
        }
    }

    /// Pushes out the newest waiter of the tenant with the most waiters.
    fn evict_from_largest(&mut self) -> bool {
        let Some(key) = self
            .tenants
            .iter()
            .max_by_key(|(_, t)| t.live)
            .map(|(k, _)| Arc::clone(k))
        else {
            return false;
        };
        let Some(tenant) = self.tenants.get_mut(&key) else {
            return false;
        };
        while let Some(tx) = tenant.waiters.pop_back() {
            if tx.send(Admit::Evicted).is_ok() {
                tenant.live -= 1;
                self.live -= 1;
                if tenant.live == 0 {
                    self.tenants.remove(&key);
                    self.order.retain(|k| *k != key);
                }
                return true;
            }
        }
        false
    }
}

//! [`MemoryConfig`]: the sizing of a [`MemoryStore`](super::MemoryStore).

use std::num::NonZeroUsize;

use crate::ConfigError;

/// Sizing of a [`MemoryStore`](super::MemoryStore).
#[derive(Debug, Clone, Copy)]
pub struct MemoryConfig {
    pub(super) max_keys: NonZeroUsize,
    pub(super) shards: NonZeroUsize,
}

impl MemoryConfig {
    /// At most `max_keys` keys, in a number of shards chosen from the CPU count.
    pub fn new(max_keys: NonZeroUsize) -> Self {
        let cpus = std::thread::available_parallelism().map_or(4, NonZeroUsize::get);
        // Enough shards that threads rarely meet, each holding at least 64 keys.
        let most = (max_keys.get() / 64).max(1);
        let most = 1 << most.ilog2();
        let shards = (cpus * 32).next_power_of_two().min(most);
        MemoryConfig {
            max_keys,
            shards: NonZeroUsize::new(shards).unwrap_or(NonZeroUsize::MIN),
        }
    }

    /// Sets the shard count, a power of two no larger than `max_keys`. The
    /// shard count only spreads lock contention: the key cap is global.
    pub fn shards(mut self, shards: NonZeroUsize) -> Result<Self, ConfigError> {
        if !shards.is_power_of_two() || shards > self.max_keys {
            return Err(ConfigError::new(
                "shards",
                "must be a power of two no larger than max_keys",
            ));
        }
        self.shards = shards;
        Ok(self)
    }
}

impl Default for MemoryConfig {
    /// 100,000 keys.
    fn default() -> Self {
        Self::new(NonZeroUsize::new(100_000).unwrap_or(NonZeroUsize::MIN))
    }
}

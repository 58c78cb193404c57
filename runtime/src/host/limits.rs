//! What one attempt may take from the machine inside wasmtime: memory and
//! time.
//!
//! - [`AttemptLimits`] is the store's resource limiter. A queue's `memory`
//!   bounds the **sum** of every linear memory the attempt's instances create
//!   or grow (a component may hold several core instances, each with its own
//!   memories), not each memory alone.
//! - [`Deadline`] is the store's epoch callback. Each epoch tick (2 ms) a
//!   guest that computes hands its worker thread back to the runtime, so that
//!   the API, heartbeats and the systemd watchdog keep answering while every
//!   slot runs a computing guest; once the queue's `timeout` has passed the
//!   guest is interrupted instead.

use std::time::{Duration, Instant};

use wasmtime::{ResourceLimiter, UpdateDeadline};

/// Table elements one table may reach (a table entry is a pointer or two:
/// 2^20 of them is a few MiB).
const TABLE_ELEMENTS: usize = 1 << 20;
/// Core instances, tables and memories one attempt may create. Real
/// components have a handful of each; the pool has room for these per slot.
pub const INSTANCES: usize = 32;
pub const TABLES: usize = 8;
pub const MEMORIES: usize = 8;

/// The resource limiter of one attempt's store.
///
/// Invariant: `used` is the sum of the current sizes of every linear memory
/// the store has created; a store never frees a memory, so growth is the
/// only change and the sum is kept by adding what each growth adds.
#[derive(Debug)]
pub struct AttemptLimits {
    memory: usize,
    used: usize,
}

impl AttemptLimits {
    /// At most `memory` bytes of linear memory, all memories together.
    pub fn new(memory: u64) -> AttemptLimits {
        AttemptLimits {
            memory: usize::try_from(memory).unwrap_or(usize::MAX),
            used: 0,
        }
    }

    /// The bytes of linear memory the attempt holds now.
    #[cfg(test)]
    pub fn used(&self) -> usize {
        self.used
    }
}

impl ResourceLimiter for AttemptLimits {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let added = desired.saturating_sub(current);
        let total = self.used.saturating_add(added);
        if maximum.is_some_and(|max| desired > max) {
            return Ok(false);
        }
        if total > self.memory {
            // A trap, not a failed `memory.grow`: a guest whose allocator
            // sees -1 often spins or aborts with a less clear message.
            wasmtime::bail!(
                "forcing trap when growing memory to {desired} bytes: the attempt's memories would hold {total} bytes, past its limit of {} bytes",
                self.memory
            );
        }
        self.used = total;
        Ok(true)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        Err(error.context("forcing a memory growth failure to be a trap"))
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > TABLE_ELEMENTS || maximum.is_some_and(|max| desired > max) {
            wasmtime::bail!("forcing trap when growing table to {desired} elements");
        }
        Ok(true)
    }

    fn instances(&self) -> usize {
        INSTANCES
    }

    fn tables(&self) -> usize {
        TABLES
    }

    fn memories(&self) -> usize {
        MEMORIES
    }
}

/// When an attempt's time is up, and what a guest that computes does at
/// each epoch tick before then: yield to the runtime.
#[derive(Debug, Clone, Copy)]
pub struct Deadline {
    at: Instant,
}

impl Deadline {
    /// `timeout` from now.
    pub fn after(timeout: Duration) -> Deadline {
        Deadline {
            at: Instant::now() + timeout,
        }
    }

    /// The epoch callback's decision: interrupt once the deadline has
    /// passed (wall-clock time, so time spent in host calls and waiting to be
    /// polled counts), else yield and come back at the next tick.
    pub fn update(&self) -> UpdateDeadline {
        if Instant::now() >= self.at {
            UpdateDeadline::Interrupt
        } else {
            UpdateDeadline::YieldCustom(1, Box::pin(tokio::task::yield_now()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::AttemptLimits;
    use wasmtime::{Engine, Instance, Module, Store};

    const MIB: usize = 1 << 20;

    /// A core module with two memories of `pages` 64 KiB pages each.
    fn two_memories(engine: &Engine, pages: usize) -> Module {
        let wat =
            format!("(module (memory (export \"a\") {pages}) (memory (export \"b\") {pages}))");
        Module::new(engine, wat).unwrap()
    }

    fn instantiate(limit: usize, pages: usize) -> (Result<Instance, wasmtime::Error>, usize) {
        let engine = Engine::default();
        let module = two_memories(&engine, pages);
        let mut store = Store::new(&engine, AttemptLimits::new(limit as u64));
        store.limiter(|l| l);
        let instance = Instance::new(&mut store, &module, &[]);
        (instance, store.data().used())
    }

    #[test]
    fn the_memory_limit_bounds_the_sum_of_an_attempts_memories() {
        // Two memories of 20 MiB each: each fits a 32 MiB limit alone, the
        // two together do not.
        let pages = 20 * MIB / 65536;
        let (refused, _) = instantiate(32 * MIB, pages);
        let err = format!("{:#}", refused.unwrap_err());
        assert!(err.contains("forcing trap when growing memory"), "{err}");
        let (allowed, used) = instantiate(64 * MIB, pages);
        assert!(allowed.is_ok());
        assert_eq!(used, 40 * MIB);
    }

    #[test]
    fn growth_counts_against_the_same_budget() {
        let engine = Engine::default();
        let module = two_memories(&engine, 16);
        let mut store = Store::new(&engine, AttemptLimits::new(4 * MIB as u64));
        store.limiter(|l| l);
        let instance = Instance::new(&mut store, &module, &[]).unwrap();
        let a = instance.get_memory(&mut store, "a").unwrap();
        let b = instance.get_memory(&mut store, "b").unwrap();
        // 2 MiB used; a may grow by 1 MiB, then b cannot grow by 2 MiB.
        a.grow(&mut store, 16).unwrap();
        assert_eq!(store.data().used(), 3 * MIB);
        assert!(b.grow(&mut store, 32).is_err());
        assert_eq!(store.data().used(), 3 * MIB);
        assert!(b.grow(&mut store, 16).is_ok());
        assert_eq!(store.data().used(), 4 * MIB);
    }
}

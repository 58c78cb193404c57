//! The daemon's time: every decision that depends on "now" (a job's run
//! time, a backoff, a lease's expiry, a fence's dates, a retention window)
//! takes it from one [`Clock`], so that tests can move it forward
//! (`POST /v1/test/clock` in `failpoints` builds) and every part sees the
//! same time. Offline tools (`khata store copy`) read the system's.
//!
//! Invariant: a clock never goes back; [`MovableClock`] only adds to its
//! offset.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use crate::job::Millis;

/// The source of time of the daemon's queues, effects and chores.
pub trait Clock: std::fmt::Debug + Send + Sync + 'static {
    fn now(&self) -> Millis;

    /// Moves the clock forward; false for a clock that cannot be moved.
    fn advance(&self, by: Duration) -> bool {
        let _ = by;
        false
    }
}

/// The system's wall clock.
#[derive(Clone, Copy, Debug, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Millis {
        Millis::from(SystemTime::now())
    }
}

/// The wall clock plus an offset that only moves forward: the daemon's clock
/// in builds with the `failpoints` feature, so that tests can let a backoff
/// or a delay elapse without waiting for it.
#[derive(Debug, Default)]
pub struct MovableClock {
    offset_ms: AtomicU64,
}

impl Clock for MovableClock {
    fn now(&self) -> Millis {
        SystemClock.now().plus(Duration::from_millis(
            self.offset_ms.load(Ordering::Relaxed),
        ))
    }

    fn advance(&self, by: Duration) -> bool {
        let ms = u64::try_from(by.as_millis()).unwrap_or(u64::MAX);
        self.offset_ms.fetch_add(ms, Ordering::Relaxed);
        true
    }
}

/// The daemon's clock: the system's; in `failpoints` builds one that tests
/// can move forward (`POST /v1/test/clock`).
pub fn daemon() -> Arc<dyn Clock> {
    #[cfg(feature = "failpoints")]
    return Arc::new(MovableClock::default());
    #[cfg(not(feature = "failpoints"))]
    Arc::new(SystemClock)
}

//! Schedules (docs/jobs-toml.md#schedulesname): `[schedules.NAME]` cron entries that enqueue jobs.
//!
//! Invariants:
//!
//! - A firing is enqueued with the job id `schedule:<name>:<fire time>` (RFC
//!   3339, UTC), so one fire time makes at most one job however often it is
//!   enqueued: after a restart, a clock step, or by several daemons on one
//!   store. The id's deduplication lasts as long as the job is kept
//!   (`[retention] jobs`).
//! - The mark, the latest fire time enqueued per schedule, is kept in
//!   `data_dir/schedules.json`, written atomically after the enqueue is
//!   durable. It only bounds catch-up; losing it cannot fire a time twice
//!   while that time's job is kept.
//! - A schedule seen for the first time fires from now on, never for times
//!   before it existed. Fire times missed while the daemon was down (more than
//!   one due at once) follow `catch_up`: `latest`, `all` (oldest first,
//!   [`MAX_CATCH_UP`] per tick), or `none`.
//! - A schedule never spins. A fire time whose id is already taken by a job
//!   with another payload or queue (anyone may enqueue any id) is skipped
//!   with one error line; the others are enqueued as usual. Any other failed
//!   enqueue is retried after a backoff (1 s, doubling to [`MAX_BACKOFF`]),
//!   and logged once per cause, not once per try.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use croner::Cron;
use tokio_util::sync::CancellationToken;

use crate::config::{self, CatchUp, Config, parse_cron, parse_timezone};
use crate::job::{Enqueued, Millis, NewJob, canonical_json};
use crate::queue::Queues;
use crate::store::StoreError;

/// Most missed fire times one schedule enqueues per tick under `catch_up = "all"`.
pub const MAX_CATCH_UP: usize = 1_000;
/// Longest sleep between looks at the clock, so that a clock step is noticed.
const TICK: Duration = Duration::from_secs(1);
const MARKS_FILE: &str = "schedules.json";
/// The first and the longest wait before a failed enqueue is tried again.
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// A schedule whose last enqueue failed: when to try again, how long the
/// next wait is, and the cause already logged.
#[derive(Debug, Clone)]
struct Failing {
    retry_at: tokio::time::Instant,
    next_wait: Duration,
    cause: String,
}

/// A schedule ready to fire.
pub struct Plan {
    config: config::Schedule,
    cron: Cron,
    tz: chrono_tz::Tz,
    payload: String,
    max_attempts: u32,
}

/// What `GET /v1/schedules` shows of one schedule.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ScheduleView {
    pub name: String,
    pub queue: String,
    pub cron: String,
    pub timezone: String,
    pub catch_up: &'static str,
    pub next_fire: Option<String>,
    pub last_fire: Option<String>,
    pub last_error: Option<String>,
}

/// Every schedule of the configuration and where each stands.
pub struct Schedules {
    /// Replaced whole by a reload; each tick works on one snapshot.
    plans: std::sync::RwLock<Arc<Vec<Plan>>>,
    /// Wakes the firing loop when the plans change.
    changed: tokio::sync::Notify,
    marks_path: PathBuf,
    /// Latest fire time enqueued, by schedule name.
    marks: Mutex<BTreeMap<String, Millis>>,
    errors: Mutex<BTreeMap<String, String>>,
    /// Schedules backing off after a failed enqueue, by name.
    failing: Mutex<BTreeMap<String, Failing>>,
}

impl std::fmt::Debug for Schedules {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Schedules")
            .field("count", &self.plans().len())
            .finish_non_exhaustive()
    }
}

fn utc(at: Millis) -> DateTime<Utc> {
    Utc.timestamp_millis_opt(at.0)
        .single()
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

impl Plan {
    /// The first fire time after `after`.
    fn next_after(&self, after: Millis) -> Option<Millis> {
        let local = utc(after).with_timezone(&self.tz);
        self.cron
            .find_next_occurrence(&local, false)
            .ok()
            .map(|t| Millis(t.timestamp_millis()))
    }

    /// The last fire time at or before `until`.
    fn latest_until(&self, until: Millis) -> Option<Millis> {
        let local = utc(until).with_timezone(&self.tz);
        self.cron
            .find_previous_occurrence(&local, true)
            .ok()
            .map(|t| Millis(t.timestamp_millis()))
    }

    /// Fire times in `(after, until]`, oldest first, at most `limit + 1` so
    /// that the caller can tell there were more.
    fn due(&self, after: Millis, until: Millis, limit: usize) -> Vec<Millis> {
        let mut out = Vec::new();
        let mut at = after;
        while let Some(next) = self.next_after(at) {
            if next > until || out.len() > limit {
                break;
            }
            out.push(next);
            at = next;
        }
        out
    }

    fn job_id(&self, fire: Millis) -> String {
        format!(
            "{}{}:{}",
            crate::job::SCHEDULE_ID_PREFIX,
            self.config.name,
            utc(fire).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        )
    }
}

impl Schedules {
    /// The schedules of `config`, with the marks kept in `data_dir`.
    pub fn new(config: &Config) -> Result<Schedules, String> {
        let plans = Schedules::plans_of(config)?;
        let marks_path = config.daemon.data_dir.join(MARKS_FILE);
        let marks = read_marks(&marks_path)?;
        Ok(Schedules {
            plans: std::sync::RwLock::new(Arc::new(plans)),
            changed: tokio::sync::Notify::new(),
            marks_path,
            marks: Mutex::new(marks),
            errors: Mutex::new(BTreeMap::new()),
            failing: Mutex::new(BTreeMap::new()),
        })
    }

    /// Checks the schedules of a reloaded configuration; [`Schedules::install`]
    /// then puts them in place.
    pub fn plans_of(config: &Config) -> Result<Vec<Plan>, String> {
        let mut plans = Vec::new();
        for s in config.schedules.values() {
            let key = format!("schedules.{}", s.name);
            let cron = parse_cron(&s.cron).map_err(|e| format!("{key}.cron: {e}"))?;
            let tz = parse_timezone(&s.timezone).map_err(|e| format!("{key}.timezone: {e}"))?;
            let max_attempts = config
                .queues
                .get(&s.queue)
                .map(|q| q.max_attempts)
                .ok_or_else(|| format!("{key}.queue: no [queues.{}] is configured", s.queue))?;
            plans.push(Plan {
                config: s.clone(),
                cron,
                tz,
                payload: canonical_json(&s.payload),
                max_attempts,
            });
        }
        Ok(plans)
    }

    /// Replaces the schedules (a SIGHUP reload) at `now`. A schedule whose
    /// cron line and time zone stay keeps its mark and goes on as before. One
    /// whose cron line or time zone changed fires from `now` on by the new
    /// one: the new line's times between its last fire and `now` are not
    /// caught up, as they never were its fire times. A new one fires from
    /// `now` on, as at start. Nothing already enqueued fires again (its job
    /// id is taken).
    pub fn install(&self, plans: Vec<Plan>, now: Millis) {
        let old = self.plans();
        for p in &plans {
            let name = &p.config.name;
            let changed = old.iter().any(|o| {
                o.config.name == *name
                    && (o.config.cron != p.config.cron || o.config.timezone != p.config.timezone)
            });
            let mark = self.marks.lock().ok().and_then(|m| m.get(name).copied());
            if let Some(mark) = mark.filter(|m| changed && *m < now) {
                tracing::info!(schedule = %name, from = %mark.rfc3339(), "schedule changed; it fires from now on");
                self.set_mark(name, now);
            }
        }
        if let Ok(mut p) = self.plans.write() {
            *p = Arc::new(plans);
        }
        self.changed.notify_one();
    }

    fn plans(&self) -> Arc<Vec<Plan>> {
        self.plans
            .read()
            .map(|p| Arc::clone(&p))
            .unwrap_or_default()
    }

    pub fn is_empty(&self) -> bool {
        self.plans().is_empty()
    }

    /// Where each schedule stands, at `now`.
    pub fn views(&self, now: Millis) -> Vec<ScheduleView> {
        let marks = self.marks.lock().map(|m| m.clone()).unwrap_or_default();
        let errors = self.errors.lock().map(|e| e.clone()).unwrap_or_default();
        self.plans()
            .iter()
            .map(|p| {
                let name = &p.config.name;
                let last = marks.get(name).copied();
                ScheduleView {
                    name: name.clone(),
                    queue: p.config.queue.clone(),
                    cron: p.config.cron.clone(),
                    timezone: p.config.timezone.clone(),
                    catch_up: p.config.catch_up.as_str(),
                    next_fire: p
                        .next_after(last.map_or(now, |l| l.max(now)))
                        .map(Millis::rfc3339),
                    last_fire: last.map(Millis::rfc3339),
                    last_error: errors.get(name).cloned(),
                }
            })
            .collect()
    }

    /// Fires every schedule when due until `stop`.
    pub async fn run(self: Arc<Self>, queues: Arc<Queues>, stop: CancellationToken) {
        loop {
            let now = queues.now();
            for plan in self.plans().iter() {
                self.fire_due(plan, &queues, now).await;
            }
            tokio::select! {
                () = tokio::time::sleep(self.sleep(queues.now())) => {}
                () = self.changed.notified() => {}
                () = stop.cancelled() => break,
            }
        }
    }

    /// How long until the next fire time, or the end of a backoff, at most
    /// [`TICK`].
    fn sleep(&self, now: Millis) -> Duration {
        let marks = self.marks.lock().map(|m| m.clone()).unwrap_or_default();
        let failing = self.failing.lock().map(|f| f.clone()).unwrap_or_default();
        let clock = tokio::time::Instant::now();
        self.plans()
            .iter()
            .filter_map(|p| match failing.get(&p.config.name) {
                Some(f) => Some(f.retry_at.saturating_duration_since(clock)),
                None => p
                    .next_after(marks.get(&p.config.name).copied().unwrap_or(now))
                    .map(|next| Duration::from_millis(u64::try_from(next.0 - now.0).unwrap_or(0))),
            })
            .min()
            .unwrap_or(TICK)
            .min(TICK)
    }

    /// Whether `name` is waiting out a backoff.
    fn backing_off(&self, name: &str) -> bool {
        self.failing
            .lock()
            .ok()
            .and_then(|f| {
                f.get(name)
                    .map(|f| f.retry_at > tokio::time::Instant::now())
            })
            .unwrap_or(false)
    }

    /// Records a failed enqueue: the next try waits, and the cause is
    /// logged only when it differs from the last one.
    fn failed(&self, name: &str, cause: String) {
        let Ok(mut failing) = self.failing.lock() else {
            return;
        };
        let wait = failing.get(name).map_or(FIRST_BACKOFF, |f| f.next_wait);
        let new_cause = failing.get(name).is_none_or(|f| f.cause != cause);
        if new_cause {
            tracing::error!(schedule = %name, error = %cause, retry_in = %humantime::format_duration(wait), "schedule could not enqueue; trying again with backoff (logged again only if the error changes)");
        } else {
            tracing::debug!(schedule = %name, error = %cause, retry_in = %humantime::format_duration(wait), "schedule could still not enqueue");
        }
        failing.insert(
            name.to_owned(),
            Failing {
                retry_at: tokio::time::Instant::now() + wait,
                next_wait: (wait * 2).min(MAX_BACKOFF),
                cause: cause.clone(),
            },
        );
        drop(failing);
        if let Ok(mut errors) = self.errors.lock() {
            errors.insert(name.to_owned(), cause);
        }
    }

    /// Records a successful enqueue: the backoff, if any, ends.
    fn succeeded(&self, name: &str) {
        let was_failing = self
            .failing
            .lock()
            .ok()
            .and_then(|mut f| f.remove(name))
            .is_some();
        if was_failing {
            tracing::info!(schedule = %name, "schedule enqueues again");
        }
        if let Ok(mut errors) = self.errors.lock() {
            errors.remove(name);
        }
    }

    /// Enqueues `jobs`, skipping (with one error line each) those whose id
    /// another job already holds; `Err` for any other failure.
    async fn enqueue_skipping_taken(
        &self,
        name: &str,
        queue: &str,
        mut jobs: Vec<NewJob>,
        queues: &Queues,
        now: Millis,
    ) -> Result<Vec<Enqueued>, StoreError> {
        loop {
            if jobs.is_empty() {
                return Ok(Vec::new());
            }
            // Armed by the backoff test: the store refuses this enqueue.
            if let Some(cause) = crate::failpoints::armed("schedule::enqueue") {
                return Err(StoreError::Unavailable(cause));
            }
            match queues.enqueue(queue, jobs.clone(), now).await {
                Err(StoreError::IdReused { id, index }) if index < jobs.len() => {
                    tracing::error!(schedule = %name, job = %id, "fire time skipped: its job id is already taken by a job with another payload or queue");
                    jobs.remove(index);
                }
                other => return other,
            }
        }
    }

    async fn fire_due(&self, plan: &Plan, queues: &Queues, now: Millis) {
        let name = &plan.config.name;
        if self.backing_off(name) {
            return;
        }
        let mark = self.marks.lock().ok().and_then(|m| m.get(name).copied());
        let Some(mark) = mark else {
            // First sight: fire from now on.
            self.set_mark(name, now);
            return;
        };
        let due = plan.due(mark, now, MAX_CATCH_UP);
        let Some(&first) = due.first() else {
            return;
        };
        let (due, newest) = if due.len() == 1 {
            (due, first)
        } else {
            let latest = plan.latest_until(now).unwrap_or(first);
            tracing::info!(schedule = %name, policy = plan.config.catch_up.as_str(), "catching up on missed fire times");
            match plan.config.catch_up {
                CatchUp::Latest => (vec![latest], latest),
                CatchUp::None => (Vec::new(), latest),
                // Oldest first, MAX_CATCH_UP per tick until caught up.
                CatchUp::All => {
                    let chunk: Vec<Millis> = due.into_iter().take(MAX_CATCH_UP).collect();
                    let newest = chunk.last().copied().unwrap_or(first);
                    (chunk, newest)
                }
            }
        };
        let jobs: Vec<NewJob> = due
            .iter()
            .map(|&fire| NewJob {
                queue: plan.config.queue.clone(),
                id: Some(plan.job_id(fire)),
                payload: plan.payload.clone(),
                priority: 0,
                run_at: fire,
                max_attempts: plan.max_attempts,
                dedup_key: None,
                dedup_for: None,
            })
            .collect();
        if !jobs.is_empty() {
            match self
                .enqueue_skipping_taken(name, &plan.config.queue, jobs, queues, now)
                .await
            {
                Ok(enqueued) => {
                    for e in &enqueued {
                        tracing::info!(schedule = %name, job = %e.job.id, deduplicated = e.deduplicated, "schedule fired");
                    }
                    self.succeeded(name);
                }
                Err(e) => {
                    // Left at the old mark: tried again after the backoff.
                    self.failed(name, e.to_string());
                    return;
                }
            }
        }
        self.set_mark(name, newest);
    }

    fn set_mark(&self, name: &str, at: Millis) {
        let Ok(mut marks) = self.marks.lock() else {
            return;
        };
        marks.insert(name.to_owned(), at);
        if let Err(e) = write_marks(&self.marks_path, &marks) {
            tracing::warn!(error = %e, path = %self.marks_path.display(), "schedule marks not saved; a restart may catch up again (each fire time still enqueues one job)");
        }
    }
}

/// `{ "name": "RFC 3339 time", ... }`; a missing file is no marks.
fn read_marks(path: &Path) -> Result<BTreeMap<String, Millis>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let raw: BTreeMap<String, String> = serde_json::from_str(&text)
        .map_err(|e| format!("{}: not a schedule marks file: {e}", path.display()))?;
    raw.into_iter()
        .map(|(name, at)| {
            let t = DateTime::parse_from_rfc3339(&at)
                .map_err(|e| format!("{}: {name}: {at:?}: {e}", path.display()))?;
            Ok((name, Millis(t.timestamp_millis())))
        })
        .collect()
}

/// Written to a temporary file, synced, then renamed over the old one.
fn write_marks(path: &Path, marks: &BTreeMap<String, Millis>) -> std::io::Result<()> {
    use std::io::Write as _;
    let raw: BTreeMap<&str, String> = marks
        .iter()
        .map(|(k, v)| {
            (
                k.as_str(),
                utc(*v).to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            )
        })
        .collect();
    let text = serde_json::to_string_pretty(&raw).map_err(std::io::Error::other)?;
    let tmp = path.with_extension("json.tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(cron: &str, tz: &str) -> Plan {
        Plan {
            config: config::Schedule {
                name: "s".into(),
                queue: "q".into(),
                cron: cron.into(),
                timezone: tz.into(),
                payload: serde_json::json!({}),
                catch_up: CatchUp::Latest,
            },
            cron: parse_cron(cron).unwrap(),
            tz: parse_timezone(tz).unwrap(),
            payload: "{}".into(),
            max_attempts: 1,
        }
    }

    fn at(s: &str) -> Millis {
        Millis(DateTime::parse_from_rfc3339(s).unwrap().timestamp_millis())
    }

    #[test]
    fn fire_times_follow_the_time_zone() {
        let p = plan("0 6 * * *", "Europe/Berlin");
        // 06:00 in Berlin in winter is 05:00 UTC.
        let next = p.next_after(at("2026-12-03T12:00:00Z")).unwrap();
        assert_eq!(p.job_id(next), "schedule:s:2026-12-04T05:00:00Z");
        // In summer, 04:00 UTC.
        let next = p.next_after(at("2026-07-01T12:00:00Z")).unwrap();
        assert_eq!(p.job_id(next), "schedule:s:2026-07-02T04:00:00Z");
    }

    #[test]
    fn due_lists_missed_times_in_order_and_stops_at_the_limit() {
        let p = plan("*/15 * * * *", "UTC");
        let due = p.due(at("2026-12-03T10:00:00Z"), at("2026-12-03T11:00:00Z"), 100);
        let ids: Vec<_> = due.iter().map(|&d| p.job_id(d)).collect();
        assert_eq!(
            ids,
            [
                "schedule:s:2026-12-03T10:15:00Z",
                "schedule:s:2026-12-03T10:30:00Z",
                "schedule:s:2026-12-03T10:45:00Z",
                "schedule:s:2026-12-03T11:00:00Z"
            ]
        );
        assert_eq!(
            p.due(at("2026-12-03T10:00:00Z"), at("2026-12-04T10:00:00Z"), 10)
                .len(),
            11
        );
    }

    #[test]
    fn bad_cron_and_zone_are_named() {
        assert!(
            parse_cron("61 * * * *")
                .unwrap_err()
                .contains("\"61 * * * *\"")
        );
        assert!(parse_timezone("Mars/Olympus").unwrap_err().contains("IANA"));
    }

    #[test]
    fn marks_survive_a_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(MARKS_FILE);
        assert!(read_marks(&path).unwrap().is_empty());
        let marks = BTreeMap::from([("a".to_owned(), at("2026-12-03T10:15:00.250Z"))]);
        write_marks(&path, &marks).unwrap();
        assert_eq!(read_marks(&path).unwrap(), marks);
    }
}

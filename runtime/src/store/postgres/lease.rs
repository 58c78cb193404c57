//! Leasing: the one-statement lease (limits, tokens, attempts) and waking
//! the daemons that wait for room in a queue.

use super::*;

/// The attempts of queue `$1` in flight at `$at` (an SQL scalar subquery):
/// unexpired leases, except the tokens of the `bigint[]` parameter
/// `$ending` (attempts of this daemon whose finishes are on their way) while
/// no daemon waits for room in the queue. See [`lease_step`].
macro_rules! in_flight_sql {
    ($at:literal, $ending:literal) => {
        concat!(
            "(SELECT COUNT(*) FROM jobs WHERE queue = $1 AND state = 'active' AND lease_expires_at > ",
            $at,
            " AND (lease_token <> ALL(",
            $ending,
            "::bigint[]) OR EXISTS (SELECT 1 FROM queue_waits WHERE queue = $1)))"
        )
    };
}

/// The lease, in one statement: it counts the queue's attempts in flight
/// (`$3`, the concurrency, not NULL) and its starts in the window (`$4`, the
/// window in ms, above 0; `$5` starts at most in it), leases what is left of
/// `$2` from the head of the ready order (`FOR UPDATE SKIP LOCKED`), gives
/// the leased jobs tokens from `fencing_tokens` that grow in delivery order,
/// opens their attempts (started at `$6` on the caller's clock and at `t` on
/// the database's), records their starts for the rate limit, and records a
/// wait when the concurrency leaves no room. Other parameters: `$1` the
/// queue, `$7` the owner, `$8` the lease in ms, `$9` the plugin version,
/// `$10` the ending tokens (see [`in_flight_sql`]).
///
/// The jobs are moved by their ids as an array (an index scan of the
/// primary key whatever the plan's guess of how many were picked: a join
/// with `picked` would be planned for the unknown `LIMIT`'s default share
/// of the queue and scan the whole table).
///
/// One row for each job leased, in delivery order, or one row with NULL job
/// columns: `t`, the room by concurrency and by rate, the start whose exit
/// from the window gives room again (only when the rate limit binds), then
/// the job's id, payload, attempt, max attempts, enqueue time and token.
pub(super) const LEASE_SQL: &str = concat!(
    "WITH t AS MATERIALIZED (SELECT clock_timestamp() AS t), \
     n AS MATERIALIZED (SELECT t.t, \
         CASE WHEN $3::bigint IS NULL THEN 0 ELSE ",
    in_flight_sql!("t.t", "$10"),
    " END AS active, \
         CASE WHEN $4::bigint > 0 THEN (SELECT COUNT(*) FROM queue_starts WHERE queue = $1 \
             AND at > t.t - $4::bigint * interval '1 millisecond') ELSE 0 END AS started \
         FROM t), \
     r AS MATERIALIZED (SELECT n.t, n.started, \
         CASE WHEN $3::bigint IS NULL THEN $2::bigint ELSE GREATEST($3::bigint - n.active, 0) END AS by_conc, \
         CASE WHEN $4::bigint > 0 THEN GREATEST($5::bigint - n.started, 0) ELSE $2::bigint END AS by_rate \
         FROM n), \
     picked AS MATERIALIZED (SELECT id, priority, run_at, seq FROM jobs \
         WHERE queue = $1 AND state = 'waiting' AND run_at <= $6 \
         ORDER BY priority DESC, run_at, seq \
         LIMIT (SELECT LEAST($2::bigint, by_conc, by_rate) FROM r) FOR UPDATE SKIP LOCKED), \
     ordered AS (SELECT id, row_number() OVER (ORDER BY priority DESC, run_at, seq) AS k FROM picked), \
     tokens AS (SELECT row_number() OVER (ORDER BY token) AS k, token \
         FROM (SELECT nextval('fencing_tokens') AS token FROM picked) s), \
     assigned AS MATERIALIZED (SELECT o.id, tk.token FROM ordered o JOIN tokens tk ON tk.k = o.k), \
     leased AS (UPDATE jobs j SET state = 'active', attempt = j.attempt + 1, \
             budget_used = j.budget_used + 1, \
             lease_token = (SELECT a.token FROM assigned a WHERE a.id = j.id), lease_owner = $7, \
             lease_expires_at = clock_timestamp() + $8::bigint * interval '1 millisecond' \
         WHERE j.id = ANY (ARRAY(SELECT id FROM assigned)) \
         RETURNING j.id, j.payload, j.attempt, j.max_attempts, j.enqueued_at, j.lease_token), \
     opened AS (INSERT INTO attempts (job_id, number, token, started_at, outcome, plugin_version, leased_at) \
         SELECT id, attempt, lease_token, $6, 'running', $9, (SELECT t FROM t) FROM leased), \
     aged AS (DELETE FROM queue_starts WHERE $4::bigint > 0 AND queue = $1 \
         AND at <= (SELECT t FROM t) - $4::bigint * interval '1 millisecond' \
         AND EXISTS (SELECT 1 FROM leased)), \
     counted AS (INSERT INTO queue_starts (queue, at) \
         SELECT $1, (SELECT t FROM t) FROM leased WHERE $4::bigint > 0), \
     waited AS (INSERT INTO queue_waits (queue) SELECT $1 FROM r \
         WHERE r.by_conc = 0 AND $2::bigint > 0 AND NOT ($4::bigint > 0 AND r.by_rate <= r.by_conc) \
         ON CONFLICT DO NOTHING) \
     SELECT r.t, r.by_conc, r.by_rate, \
         CASE WHEN LEAST($2::bigint, r.by_conc, r.by_rate) < $2::bigint AND $4::bigint > 0 \
             AND r.by_rate <= r.by_conc THEN (SELECT at FROM queue_starts WHERE queue = $1 \
                 AND at > r.t - $4::bigint * interval '1 millisecond' \
                 ORDER BY at OFFSET GREATEST(r.started - $5::bigint, 0) LIMIT 1) END, \
         l.id, l.payload, l.attempt, l.max_attempts, l.enqueued_at, l.lease_token \
     FROM r LEFT JOIN leased l ON true ORDER BY l.lease_token"
);

/// Counts the attempts of queue `$1` in flight now ([`in_flight_sql`],
/// `$2` the ending tokens).
pub(super) const IN_FLIGHT_SQL: &str =
    concat!("SELECT ", in_flight_sql!("clock_timestamp()", "$2"));

/// Takes a queue's limited leases one at a time across daemons
/// ([`lease_step`]).
pub(super) const QUEUE_LOCK_SQL: &str = "SELECT pg_advisory_xact_lock($1, hashtext($2))";

/// The lease of up to `max` jobs of `queue` for `owner`, within `limits`
/// ([`LEASE_SQL`]).
///
/// With limits, it first takes the queue's transaction advisory lock, held
/// to its commit: the limited leases of one queue run one at a time, on
/// every daemon, so what this one counts (the queue's attempts in flight,
/// its starts in the window) cannot change before it commits its own
/// leases, except downwards (an attempt ends, a lease expires). The lease
/// statement after the lock sees every lease committed before the lock was
/// granted (READ COMMITTED: a snapshot per statement). Times are the
/// database's: `t`, read once under the lock, is the start of every attempt
/// leased here, and later than every start already recorded.
///
/// In flight: an unexpired lease, except the attempts in `ending` (this
/// daemon's, whose handlers have ended and whose finishes are on their
/// way). Other daemons' ending attempts count until their finishes commit:
/// the bound is never looser than the handlers running. While a daemon
/// waits for room (a row in `queue_waits`), `ending` counts too: the
/// daemon whose attempts end would otherwise take their room again before
/// their commit wakes the waiting ones, and keep the queue to itself.
#[allow(clippy::too_many_arguments)]
pub(super) async fn lease_step<C: GenericClient>(
    c: &C,
    queue: &str,
    max: u32,
    plugin_version: &str,
    now: Millis,
    (owner, lease_ms): (&str, i64),
    limits: &LeaseLimits,
    ending: &[i64],
) -> Result<Leased, Fail> {
    let concurrency = limits.concurrency.map(i64::from);
    let (per_ms, per_max) = limits.rate.map_or((0, 0), |r| {
        (
            i64::try_from(r.per.as_millis()).unwrap_or(i64::MAX),
            i64::from(r.max),
        )
    });
    let max_rows = i64::from(max);
    let params: Params<'_> = &[
        &queue,
        &max_rows,
        &concurrency,
        &per_ms,
        &per_max,
        &now.0,
        &owner,
        &lease_ms,
        &plugin_version,
        &ending,
    ];
    let lease = c.prepare_cached(LEASE_SQL).await?;
    let found = if limits.concurrency.is_some() || limits.rate.is_some() {
        let lock = c.prepare_cached(QUEUE_LOCK_SQL).await?;
        let key: Params<'_> = &[&QUEUE_LOCK, &queue];
        // Pipelined: both are sent at once (first polled, first sent) and
        // the server runs them in that order, so the lease's snapshot is
        // taken after the lock was granted.
        let (_, found) = tokio::try_join!(c.execute(&lock, key), c.query(&lease, params))?;
        found
    } else {
        c.query(&lease, params).await?
    };
    let first = found.first().ok_or_else(|| unavailable("no row"))?;
    let t: SystemTime = first.try_get(0)?;
    let room = |v: i64| u32::try_from(v).unwrap_or(u32::MAX);
    let by_conc = room(first.try_get(1)?);
    let by_rate = room(first.try_get(2)?);
    let oldest: Option<SystemTime> = first.try_get(3)?;
    let want = max.min(by_conc).min(by_rate);
    let held = match limits.rate {
        _ if want == max => None,
        // `by_rate < max`: there is a rate limit, and it binds. Room comes
        // back when the start `max` places before the newest leaves the
        // window.
        Some(w) if by_rate <= by_conc => {
            let wait = oldest.map_or(Duration::ZERO, |at| {
                (at + w.per).duration_since(t).unwrap_or_default()
            });
            Some(Held::Rate(wait.max(Duration::from_millis(1))))
        }
        _ => Some(Held::Concurrency),
    };
    let mut leases = Vec::with_capacity(found.len());
    for r in &found {
        let Some(job_id) = r.try_get::<_, Option<String>>(4)? else {
            break;
        };
        leases.push(Lease {
            job_id,
            queue: queue.to_owned(),
            payload: r.try_get(5)?,
            attempt: u32_of(r.try_get(6)?),
            max_attempts: u32_of(r.try_get(7)?),
            enqueued_at: Millis(r.try_get(8)?),
            token: u64_of(r.try_get(9)?),
        });
    }
    Ok(Leased { leases, held })
}

/// Wakes the daemons waiting for room in `queues`' concurrency, once per
/// wait: attempts of theirs ended. Run after, never inside, the transaction
/// that ended them, in a statement of its own (no write, hence no flush,
/// unless a daemon waits).
///
/// No wake-up is lost, and an attempt's end never waits for a limited
/// lease's lock: a lease held back records its wait, commits, and only then
/// counts again (`Store::lease`). Either this statement ran after that
/// wait's commit, and sees it, or it ran before, hence after the attempts'
/// end committed, and that second count no longer holds them.
pub(super) async fn wake_waiting(
    pool: &Pool,
    target: &str,
    queues: &[String],
) -> Result<(), StoreError> {
    if queues.is_empty() {
        return Ok(());
    }
    let client = pool_client(pool, target).await?;
    rows(
        &client,
        "WITH w AS (DELETE FROM queue_waits WHERE queue = ANY($1::text[]) RETURNING queue) \
         SELECT pg_notify($2, queue) FROM w",
        &[&queues, &WAKE_CHANNEL],
    )
    .await
    .map_err(store_err)?;
    Ok(())
}

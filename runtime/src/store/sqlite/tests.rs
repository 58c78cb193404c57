use std::sync::Arc;

use super::SqliteStore;
use crate::store::Store;

crate::conformance_tests!(|| async {
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(dir.path()).expect("open"));
    (dir, store)
});

/// Readers that always hold a snapshot starve SQLite's passive
/// checkpoints; the writer's own checkpoint keeps the WAL bounded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wal_stays_bounded_while_readers_never_let_go() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let dir = tempfile::tempdir().expect("tempdir");
    let store = SqliteStore::open(dir.path()).expect("open");
    let db = store.path().to_owned();
    let stop = Arc::new(AtomicBool::new(false));
    // Two readers whose read transactions overlap: at every moment one
    // of them holds a snapshot.
    let readers: Vec<_> = (0..2)
        .map(|i| {
            let (db, stop) = (db.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let conn = rusqlite::Connection::open(&db).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(5 * i));
                while !stop.load(Ordering::Relaxed) {
                    conn.execute_batch("BEGIN").unwrap();
                    let _: i64 = conn
                        .query_row("SELECT count(*) FROM jobs", [], |r| r.get(0))
                        .unwrap();
                    std::thread::sleep(std::time::Duration::from_millis(10));
                    conn.execute_batch("COMMIT").unwrap();
                }
            })
        })
        .collect();
    let payload = format!("\"{}\"", "x".repeat(64 << 10));
    let mut biggest = 0;
    for batch in 0..40 {
        let jobs = (0..50)
            .map(|i| crate::job::NewJob {
                queue: "q".into(),
                id: Some(format!("{batch}-{i}")),
                payload: payload.clone(),
                priority: 0,
                run_at: crate::job::Millis(0),
                max_attempts: 1,
                dedup_key: None,
                dedup_for: None,
            })
            .collect();
        store.enqueue(jobs, crate::job::Millis(0)).await.unwrap();
        let wal = std::fs::metadata(format!("{}-wal", db.display())).map_or(0, |m| m.len());
        biggest = biggest.max(wal);
    }
    stop.store(true, Ordering::Relaxed);
    for r in readers {
        r.join().unwrap();
    }
    // 130 MB were written; the WAL never held much more than its limit.
    assert_eq!(super::WAL_LIMIT, 64 << 20);
    assert!(biggest < 72 << 20, "the WAL reached {biggest} bytes");
}

#[test]
fn a_second_daemon_is_kept_off_the_ledger() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _first = SqliteStore::open(dir.path()).expect("open");
    let second = SqliteStore::open(dir.path());
    assert!(
        second
            .unwrap_err()
            .to_string()
            .contains("another khata daemon")
    );
}

#[tokio::test]
async fn migrating_a_version_one_ledger_counts_its_jobs() {
    let dir = tempfile::tempdir().expect("tempdir");
    {
        let conn = rusqlite::Connection::open(dir.path().join("khata.db")).unwrap();
        conn.execute_batch(super::MIGRATIONS[0]).unwrap();
        conn.pragma_update(None, "user_version", 1).unwrap();
        for (i, state) in ["waiting", "waiting", "completed", "dead"]
            .iter()
            .enumerate()
        {
            conn.execute(
                "INSERT INTO jobs (id, queue, state, payload, priority, run_at, seq, max_attempts, enqueued_at) \
                 VALUES (?1, 'q', ?2, '{}', 0, 0, ?1, 3, 0)",
                rusqlite::params![i64::try_from(i).unwrap(), state],
            )
            .unwrap();
        }
    }
    let store = SqliteStore::open(dir.path()).expect("open");
    let counts = store.counts(crate::job::Millis(1)).await.unwrap();
    let q = &counts[0].1;
    assert_eq!((q.waiting, q.completed, q.dead), (2, 1, 1), "{q:?}");
}

/// Migration 4 gives each kv entry of an older ledger a write time (the
/// migration's), from which `[retention] kv` counts.
#[test]
fn migrating_a_version_three_ledger_dates_its_kv_entries() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("khata.db");
    {
        let conn = rusqlite::Connection::open(&path).unwrap();
        for sql in &super::MIGRATIONS[..3] {
            conn.execute_batch(sql).unwrap();
        }
        conn.pragma_update(None, "user_version", 3).unwrap();
        conn.execute(
            "INSERT INTO kv (namespace, key, value) VALUES ('ns', 'k', x'01')",
            [],
        )
        .unwrap();
    }
    let before = crate::job::Millis::now().0;
    drop(SqliteStore::open(dir.path()).expect("open migrates"));
    let conn = rusqlite::Connection::open(&path).unwrap();
    let (value, written_at): (Vec<u8>, i64) = conn
        .query_row("SELECT value, written_at FROM kv", [], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .unwrap();
    assert_eq!(value, [1]);
    assert!(
        (before - 1_000..=crate::job::Millis::now().0 + 1_000).contains(&written_at),
        "written_at {written_at}, migrated at about {before}"
    );
}

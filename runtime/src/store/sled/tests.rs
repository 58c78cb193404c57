use crate::store::PutMode;
use crate::store::conformance::{LeaseUpTo, doc_at, put, tombstone};
use std::sync::Arc;

use super::SledStore;
use crate::store::Store;

crate::conformance_tests!(|| async {
    let dir = tempfile::tempdir().expect("tempdir");
    let store: Arc<dyn Store> = Arc::new(SledStore::open(dir.path()).expect("open"));
    (dir, store)
});

#[test]
fn a_second_daemon_is_kept_off_the_ledger() {
    let dir = tempfile::tempdir().expect("tempdir");
    let _first = SledStore::open(dir.path()).expect("open");
    let second = SledStore::open(dir.path());
    assert!(
        second
            .unwrap_err()
            .to_string()
            .contains("another khata daemon")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reopened_ledger_keeps_jobs_fences_and_the_token_order() {
    use crate::job::{Finish, Millis, NewJob};
    use crate::store::{FenceBegin, FenceId};
    let dir = tempfile::tempdir().expect("tempdir");
    let now = Millis(1_700_000_000_000);
    let job = |id: &str| NewJob {
        queue: "q".into(),
        id: Some(id.into()),
        payload: "{}".into(),
        priority: 0,
        run_at: now,
        max_attempts: 3,
        dedup_key: None,
        dedup_for: None,
    };
    let fence = FenceId {
        namespace: "q".into(),
        kind: "http".into(),
        key: "charge-1".into(),
    };
    let first_token = {
        let s = SledStore::open(dir.path()).expect("open");
        s.enqueue(vec![job("a"), job("b")], now).await.unwrap();
        let l = s.lease_up_to("q", 1, "v1", now).await.unwrap().remove(0);
        let lease = l.fence();
        assert_eq!(
            s.fence_begin(&lease, &fence, b"fp", now).await.unwrap(),
            FenceBegin::Started
        );
        s.fence_done(&lease, &fence, b"paid".to_vec(), now)
            .await
            .unwrap();
        s.finish(
            &lease,
            Finish::Completed {
                result: "{}".into(),
            },
            now,
        )
        .await
        .unwrap();
        // Leased, never finished: the next start recovers it.
        s.lease_up_to("q", 1, "v1", now)
            .await
            .unwrap()
            .remove(0)
            .token
    };
    let s = SledStore::open(dir.path()).expect("reopen");
    assert_eq!(s.recover(now).await.unwrap(), 1);
    let l = s.lease_up_to("q", 1, "v1", now).await.unwrap().remove(0);
    assert_eq!(l.job_id, "b");
    assert!(l.token > first_token, "tokens only grow across a reopen");
    assert_eq!(
        s.fence_begin(&l.fence(), &fence, b"fp", now).await.unwrap(),
        FenceBegin::Replay(b"paid".to_vec())
    );
    let a = s.job("a", now).await.unwrap().unwrap();
    assert_eq!(a.state, crate::job::JobState::Completed);
    let counts = s.counts(now).await.unwrap();
    assert_eq!((counts[0].1.completed, counts[0].1.active), (1, 1));
    let page = s
        .jobs(
            crate::store::JobFilter {
                limit: 10,
                ..Default::default()
            },
            now,
        )
        .await
        .unwrap();
    let ids: Vec<_> = page.jobs.iter().map(|j| j.id.as_str()).collect();
    assert_eq!(ids, ["b", "a"], "newest first, seq kept across the reopen");
    s.enqueue(vec![job("c")], now).await.unwrap();
    let page = s
        .jobs(
            crate::store::JobFilter {
                limit: 1,
                ..Default::default()
            },
            now,
        )
        .await
        .unwrap();
    assert_eq!(
        page.jobs[0].id, "c",
        "a new job's seq is above the old ones"
    );
}

/// A layout 1 ledger (no dead, kv_by_time or tombstones trees; kv
/// values without their write time) is brought to layout 2 when it
/// opens: its kv reads as before and retention finds its dead jobs, kv
/// entries and tombstones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_layout_1_ledger_is_migrated_when_it_opens() {
    use std::time::Duration;

    use super::{DIR_NAME, LAYOUT_VERSION, split_kv_value};
    use crate::job::{AttemptOutcome, Finish, Millis, NewJob};
    use crate::store::RetentionRules;
    let dir = tempfile::tempdir().expect("tempdir");
    let t0 = Millis(1_700_000_000_000);
    let job = |id: &str| NewJob {
        queue: "q".into(),
        id: Some(id.into()),
        payload: "{}".into(),
        priority: 0,
        run_at: t0,
        max_attempts: 1,
        dedup_key: None,
        dedup_for: None,
    };
    {
        let s = SledStore::open(dir.path()).expect("open");
        s.enqueue(vec![job("a")], t0).await.unwrap();
        let l = s
            .lease_up_to("q", 1, "v1", t0)
            .await
            .unwrap()
            .remove(0)
            .fence();
        s.kv_put(&l, put("ns", "k", b"value".to_vec(), PutMode::Replace), t0)
            .await
            .unwrap();
        s.index_upsert(&l, doc_at("docs", "d", 1, "{}"), t0)
            .await
            .unwrap();
        assert!(
            s.index_remove(&l, tombstone("docs", "d", 2), t0)
                .await
                .unwrap()
        );
        let fail = Finish::Fail {
            outcome: AttemptOutcome::Failed,
            error: "x".into(),
        };
        s.finish(&l, fail, t0).await.unwrap();
    }
    // Rewrite it as layout 1 wrote it.
    {
        let db = sled::open(dir.path().join(DIR_NAME)).expect("sled");
        for name in ["dead", "kv_by_time", "tombstones"] {
            db.open_tree(name).unwrap().clear().unwrap();
        }
        let kv = db.open_tree("kv").unwrap();
        for entry in kv.iter() {
            let (k, v) = entry.unwrap();
            let (_, bare) = split_kv_value(&v).unwrap();
            kv.insert(k, bare).unwrap();
        }
        let meta = db.open_tree("meta").unwrap();
        meta.insert(b"layout", &1u64.to_be_bytes()).unwrap();
        db.flush().unwrap();
    }
    let s = SledStore::open(dir.path()).expect("reopen migrates");
    assert_eq!(s.trees.meta("layout").unwrap(), Some(LAYOUT_VERSION));
    s.enqueue(vec![job("b")], t0).await.unwrap();
    let l = s
        .lease_up_to("q", 1, "v1", t0)
        .await
        .unwrap()
        .remove(0)
        .fence();
    assert_eq!(
        s.kv_get(&l, "ns", "k").await.unwrap().as_deref(),
        Some(&b"value"[..]),
        "kv reads as before"
    );
    let day = Duration::from_secs(86_400);
    let rules = RetentionRules {
        jobs: day,
        dead: day,
        fences: day,
        tombstones: day,
        kv: vec![("ns".into(), day)],
    };
    // Dead jobs and tombstones keep their times; a layout 1 kv entry had
    // none, and counts from the migration.
    let swept = s.sweep(t0.plus(day * 2), &rules, 100).await.unwrap();
    assert_eq!(
        (swept.dead_jobs, swept.kv, swept.tombstones),
        (1, 0, 1),
        "{swept:?}"
    );
    let far = Millis::now().plus(day * 2);
    let swept = s.sweep(far, &rules, 100).await.unwrap();
    assert_eq!(swept.kv, 1, "{swept:?}");
}

#[test]
fn keys_sort_in_delivery_order() {
    use super::{Millis, ready_key};
    let mut keys = [
        (ready_key("q", -5, Millis(10), 1), "low"),
        (ready_key("q", 0, Millis(-3), 9), "zero-early"),
        (ready_key("q", 0, Millis(20), 2), "zero-late-first"),
        (ready_key("q", 0, Millis(20), 3), "zero-late-second"),
        (ready_key("q", 7, Millis(99), 4), "high"),
    ];
    keys.sort();
    let order: Vec<_> = keys.iter().map(|(_, n)| *n).collect();
    assert_eq!(
        order,
        [
            "high",
            "zero-early",
            "zero-late-first",
            "zero-late-second",
            "low"
        ]
    );
}

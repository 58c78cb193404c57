//! The Python, JavaScript and C example plugins, built with their SDKs by
//! `scripts/build-plugins`, run through the real daemon and behave as their
//! Rust twins: run twice, the effect happens once; through three `kill -9`,
//! one charge per order and at most one email per user.
//!
//! Their components are big (an interpreter each), so a fresh data_dir
//! compiles for a while before the daemon answers; every restart after that
//! must read the compiled code from the cache in data_dir.

use crate::servers;
use crate::support;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use servers::{Payments, Smtp};
use support::{Daemon, payload};

/// How long a first start (compiling a big guest) may take.
const FIRST_START: Duration = Duration::from_secs(600);
/// How many jobs the crash tests run: enough for three kills to land
/// mid-run, few enough to keep the suite quick.
const CRASH_JOBS: u64 = 150;

fn charge_queue(base_url: &str, queue_extra: &str) -> String {
    format!(
        "[queues.charge]\nplugin = \"charge_customer\"\ngrants = {{ http = [\"payments\"] }}\n{queue_extra}\n\
         [http.payments]\nbase_url = \"{base_url}\"\ntimeout = \"5s\"\nidempotency_header = \"Idempotency-Key\"\n"
    )
}

fn welcome_queue(smtp_port: u16, queue_extra: &str) -> String {
    format!(
        "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = {{ kv = true, email = true }}\n{queue_extra}\n\
         [email]\ntransport = \"smtp\"\nfrom = \"hello@example.com\"\nhost = \"127.0.0.1\"\nport = {smtp_port}\ntls = \"none\"\ntimeout = \"5s\"\n"
    )
}

/// Starts a daemon serving `guest` as plugin `file` for `queue`, and waits
/// until the plugin is loaded (compiled: the data_dir is fresh).
async fn start(config: &str, file: &str, guest: &str, queue: &str) -> Daemon {
    let mut d = Daemon::prepare(config, &[(file, guest)]);
    d.start_within(FIRST_START).await;
    d.wait_plugin(queue).await;
    assert_eq!(d.queue(queue).await["code"], "compiled", "a fresh data_dir");
    d
}

/// Kills the daemon three times at moments spread over the run, restarting
/// it each time; each restart must find the compiled code in the cache.
/// The first kill must land before every one of the queue's `total` jobs
/// ended (the servers' delays make the run long enough), or the test would
/// prove nothing about crashes.
async fn three_kills(d: &mut Daemon, queue: &str, total: u64) {
    for (n, pause) in [300, 700, 500].into_iter().enumerate() {
        tokio::time::sleep(Duration::from_millis(pause)).await;
        if n == 0 {
            let c = &d.queue(queue).await["counts"];
            let ended = c["completed"].as_u64().unwrap() + c["dead"].as_u64().unwrap();
            assert!(ended < total, "every job ended before the first kill: {c}");
        }
        d.kill9();
        d.start().await;
        d.wait_plugin(queue).await;
        let q = d.queue(queue).await;
        assert_eq!(
            q["code"], "cache",
            "the restart read the compiled code: {q}"
        );
    }
}

/// Waits until `total` jobs of `queue` are completed or dead.
async fn wait_ended(d: &Daemon, queue: &str, total: u64) {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let c = &d.queue(queue).await["counts"];
        if c["completed"].as_u64().unwrap() + c["dead"].as_u64().unwrap() == total {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "jobs did not end: {c}\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn enqueue_batch(d: &Daemon, queue: &str, jobs: Vec<Value>) {
    let (status, v) = d
        .call(
            "POST",
            &format!("/v1/queues/{queue}/jobs/batch"),
            Some(json!({ "jobs": jobs })),
        )
        .await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test]
async fn js_charge_customer_charges_once_when_run_twice() {
    let payments = Payments::start().await;
    let d = start(
        &charge_queue(&payments.url(), "max_attempts = 1"),
        "charge_customer",
        "charge_customer_js",
        "charge",
    )
    .await;
    let order = json!({"order_id": 42, "amount": 1250, "currency": "EUR", "customer": "cus_7"});

    let first = d.enqueue("charge", payload(order.clone())).await;
    let j1 = d.wait_state(&first, "completed", 60).await;
    assert_eq!(j1["result"]["order_id"], 42, "{j1}");
    assert_eq!(j1["result"]["status"], 200, "{j1}");
    assert_eq!(j1["result"]["replayed"], false, "{j1}");
    assert_eq!(j1["result"]["charge"]["id"], "ch_1", "{j1}");
    let second = d.enqueue("charge", payload(order)).await;
    let j2 = d.wait_state(&second, "completed", 60).await;
    assert_eq!(j2["result"]["replayed"], true, "{j2}");
    assert_eq!(j2["result"]["charge"], j1["result"]["charge"]);

    let seen = payments.requests();
    assert_eq!(seen.len(), 1, "one request reached the provider: {seen:?}");
    assert_eq!(seen[0].idempotency_key.as_deref(), Some("order-charge-42"));
    assert_eq!(
        seen[0].body,
        json!({"order_id": 42, "amount": 1250, "currency": "EUR", "customer": "cus_7"}),
        "the request the Rust twin sends"
    );

    let bad = d
        .enqueue(
            "charge",
            payload(json!({"order_id": 43, "amount": 0, "currency": "EUR", "customer": "c"})),
        )
        .await;
    let j = d.wait_state(&bad, "dead", 60).await;
    assert_eq!(
        j["last_error"], "bad payload: amount must be positive, got 0",
        "{j}"
    );
    assert_eq!(
        payments.requests().len(),
        1,
        "a bad payload charges nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn js_charge_customer_charges_each_order_once_across_three_kill_nine() {
    let payments = Payments::start_with_delay(Duration::from_millis(200)).await;
    let config = charge_queue(
        &payments.url(),
        "concurrency = 16\nmax_attempts = 20\nbackoff = { initial = \"10ms\", max = \"50ms\" }",
    );
    let mut d = start(&config, "charge_customer", "charge_customer_js", "charge").await;
    let jobs = (0..CRASH_JOBS)
        .map(|i| json!({"id": format!("order-{i}"), "payload": {"order_id": i, "amount": 100, "currency": "EUR", "customer": "c"}}))
        .collect();
    enqueue_batch(&d, "charge", jobs).await;
    three_kills(&mut d, "charge", CRASH_JOBS).await;
    wait_ended(&d, "charge", CRASH_JOBS).await;

    for i in 0..CRASH_JOBS {
        let j = d.job(&format!("order-{i}")).await;
        assert_eq!(j["state"], "completed", "order {i}: {j}");
    }
    assert_eq!(
        payments.charges(),
        CRASH_JOBS as usize,
        "one charge per order"
    );
    for r in payments.requests() {
        let order = r.body["order_id"].as_u64().unwrap();
        assert_eq!(
            r.idempotency_key,
            Some(format!("order-charge-{order}")),
            "every request carries its order's key"
        );
    }
}

#[tokio::test]
async fn python_welcome_email_is_sent_once_when_run_twice() {
    welcome_email_is_sent_once_when_run_twice("welcome_email_py").await;
}

#[tokio::test]
async fn c_welcome_email_is_sent_once_when_run_twice_and_refuses_bad_payloads() {
    let (d, smtp, _tmp) = welcome_email_is_sent_once_when_run_twice("welcome_email_c").await;
    // A bad payload fails naming the field, and sends nothing.
    for (bad, expected) in [
        (
            json!({"user_id": -1, "email": "x@example.com", "name": "X"}),
            "bad payload: user_id must be a non-empty string or a non-negative integer, got -1",
        ),
        (
            json!({"user_id": "u-1", "name": "X"}),
            "bad payload: missing field `email`",
        ),
        (
            json!({"user_id": "u-1", "email": 5, "name": "X"}),
            "bad payload: email must be a string, got 5",
        ),
    ] {
        let id = d.enqueue("welcome", payload(bad)).await;
        let j = d.wait_state(&id, "dead", 60).await;
        assert_eq!(j["last_error"], expected, "{j}");
    }
    assert_eq!(smtp.messages().len(), 1, "nothing more was sent");
}

#[tokio::test]
async fn c_echo_needs_no_grant_and_returns_its_payload() {
    let d = start(
        "[queues.echo]\nplugin = \"echo\"\nmax_attempts = 1\n",
        "echo",
        "echo_c",
        "echo",
    )
    .await;
    let body = json!({"hello": "wörld", "n": [1, 2.5, null], "nested": {"ok": true}});
    let id = d.enqueue("echo", payload(body.clone())).await;
    let j = d.wait_state(&id, "completed", 60).await;
    assert_eq!(j["result"], body, "{j}");
}

/// `guest` as `welcome_email`, the twin of the Rust example: run twice, one
/// message; another message under the same user's key is refused naming
/// the user. Returns the daemon and the SMTP server (in the directory) for
/// more checks.
async fn welcome_email_is_sent_once_when_run_twice(
    guest: &str,
) -> (Daemon, Smtp, tempfile::TempDir) {
    let tmp = tempfile::tempdir().unwrap();
    let smtp = Smtp::start(&tmp.path().join("mail"));
    let d = start(
        &welcome_queue(smtp.port, "max_attempts = 1"),
        "welcome_email",
        guest,
        "welcome",
    )
    .await;
    let user = json!({"user_id": 9, "email": "bob@example.com", "name": "Bob"});

    let first = d.enqueue("welcome", payload(user.clone())).await;
    let j1 = d.wait_state(&first, "completed", 60).await;
    assert_eq!(j1["result"]["user_id"], 9, "{j1}");
    assert_eq!(j1["result"]["replayed"], false, "{j1}");
    let second = d.enqueue("welcome", payload(user)).await;
    let j2 = d.wait_state(&second, "completed", 60).await;
    assert_eq!(j2["result"]["replayed"], true, "{j2}");
    assert_eq!(j2["result"]["message_id"], j1["result"]["message_id"]);

    let messages = smtp.messages();
    assert_eq!(messages.len(), 1, "one message reached the SMTP server");
    let message_id = j1["result"]["message_id"].as_str().unwrap();
    assert!(messages[0].contains(message_id), "{}", messages[0]);
    assert!(
        messages[0].contains("Subject: Welcome, Bob!"),
        "{}",
        messages[0]
    );
    assert!(
        messages[0].contains("To: bob@example.com"),
        "{}",
        messages[0]
    );
    assert!(messages[0].contains("Hello Bob,"), "{}", messages[0]);

    // Another message under the same user's key is refused, naming the user.
    let other = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 9, "email": "bob@example.com", "name": "Robert"})),
        )
        .await;
    let j = d.wait_state(&other, "dead", 60).await;
    let error = j["last_error"].as_str().unwrap();
    assert!(
        error.starts_with("user 9 was already welcomed with a different message (key welcome:9)"),
        "{j}"
    );
    assert_eq!(smtp.messages().len(), 1, "nothing more was sent");
    (d, smtp, tmp)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn python_welcome_email_at_most_one_per_user_across_three_kill_nine() {
    welcome_email_across_three_kill_nine("welcome_email_py").await;
}

/// The C twin (`plugins/c/welcome_email_c`, built by `sdk/c`'s
/// `khata-build-c`) through the same crash test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c_welcome_email_at_most_one_per_user_across_three_kill_nine() {
    welcome_email_across_three_kill_nine("welcome_email_c").await;
}

/// `guest` as `welcome_email` through three `kill -9`: at most one email
/// per user, every user without one has an uncertain fence, and after the
/// operator resolves them and retries, exactly one each.
async fn welcome_email_across_three_kill_nine(guest: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let smtp = Smtp::start_with_delay(&tmp.path().join("mail"), Duration::from_millis(200));
    let config = welcome_queue(
        smtp.port,
        "concurrency = 16\nmax_attempts = 20\nbackoff = { initial = \"10ms\", max = \"50ms\" }",
    );
    let mut d = start(&config, "welcome_email", guest, "welcome").await;
    let jobs = (0..CRASH_JOBS)
        .map(|u| json!({"id": format!("welcome-{u}"), "payload": {"user_id": u, "email": format!("u{u}@example.com"), "name": format!("U{u}")}}))
        .collect();
    enqueue_batch(&d, "welcome", jobs).await;
    three_kills(&mut d, "welcome", CRASH_JOBS).await;
    wait_ended(&d, "welcome", CRASH_JOBS).await;

    let per_user = |smtp: &Smtp| {
        let mut n = vec![0usize; CRASH_JOBS as usize];
        for m in smtp.messages() {
            let u: usize = m
                .split("To: u")
                .nth(1)
                .and_then(|r| r.split('@').next())
                .and_then(|x| x.parse().ok())
                .expect("a To header");
            n[u] += 1;
        }
        n
    };
    let sent = per_user(&smtp);
    assert!(
        sent.iter().all(|n| *n <= 1),
        "a user got two emails: {sent:?}"
    );
    let (_, v) = d
        .call("GET", "/v1/fences?state=uncertain&limit=1000", None)
        .await;
    let uncertain = v["fences"].as_array().unwrap().clone();
    for u in 0..CRASH_JOBS {
        let j = d.job(&format!("welcome-{u}")).await;
        if j["state"] == "completed" {
            assert_eq!(
                sent[u as usize], 1,
                "user {u} completed without an email: {j}"
            );
        } else {
            assert!(
                uncertain.iter().any(|f| f["key"] == format!("welcome:{u}")),
                "user {u} is dead but not uncertain: {j}"
            );
        }
    }
    // The operator resolves each uncertain send by looking at the mail
    // server, and retries the dead jobs: then every user has one email.
    for f in &uncertain {
        let key = f["key"].as_str().unwrap();
        let user: u64 = key.trim_start_matches("welcome:").parse().unwrap();
        let outcome = if sent[user as usize] == 1 {
            "done"
        } else {
            "not-done"
        };
        let (status, v) = d
            .call(
                "POST",
                "/v1/fences/resolve",
                Some(json!({"namespace": "welcome", "kind": "email", "key": key, "outcome": outcome})),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        d.call("POST", &format!("/v1/jobs/welcome-{user}/retry"), None)
            .await;
    }
    wait_ended(&d, "welcome", CRASH_JOBS).await;
    let sent = per_user(&smtp);
    for u in 0..CRASH_JOBS {
        let j = d.job(&format!("welcome-{u}")).await;
        assert_eq!(j["state"], "completed", "{j}");
        assert_eq!(sent[u as usize], 1, "user {u} has exactly one email");
    }
}

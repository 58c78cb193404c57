//! Effects happen once (DESIGN 4), through the real daemon, against a real
//! HTTP server and a real SMTP server on 127.0.0.1.

mod servers;
mod support;

use serde_json::json;
use servers::{Payments, Smtp};
use support::{Daemon, payload};

fn charge_queue(base_url: &str, extra_provider: &str, queue_extra: &str) -> String {
    format!(
        "[queues.charge]\nplugin = \"charge_customer\"\ngrants = {{ http = [\"payments\"] }}\n{queue_extra}\n\
         [http.payments]\nbase_url = \"{base_url}\"\ntimeout = \"2s\"\n\
         headers = {{ Authorization = {{ env = \"KHATA_TEST_PAYMENTS_TOKEN\", prefix = \"Bearer \" }} }}\n{extra_provider}\n"
    )
}

fn order(id: u32) -> serde_json::Value {
    payload(json!({"order_id": id, "amount": 1250, "currency": "EUR", "customer": "cus_7"}))
}

async fn start(config: &str, plugins: &[(&str, &str)]) -> Daemon {
    let mut d = Daemon::prepare(config, plugins);
    d.env("KHATA_TEST_PAYMENTS_TOKEN", "sk_test_42");
    d.start().await;
    for q in ["charge", "welcome"] {
        if config.contains(&format!("[queues.{q}]")) {
            d.wait_plugin(q).await;
        }
    }
    d
}

#[tokio::test]
async fn a_charge_reaches_the_provider_once_and_is_replayed() {
    let payments = Payments::start().await;
    let config = charge_queue(
        &payments.url(),
        "idempotency_header = \"Idempotency-Key\"",
        "",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;

    let first = d.enqueue("charge", order(42)).await;
    let j1 = d.wait_state(&first, "completed", 30).await;
    assert_eq!(j1["result"]["replayed"], false, "{j1}");
    assert_eq!(j1["result"]["charge"]["id"], "ch_1");
    // A second job for the same order: the host replays the recorded response.
    let second = d.enqueue("charge", order(42)).await;
    let j2 = d.wait_state(&second, "completed", 30).await;
    assert_eq!(j2["result"]["replayed"], true, "{j2}");
    assert_eq!(j2["result"]["charge"], j1["result"]["charge"]);

    let seen = payments.requests();
    assert_eq!(seen.len(), 1, "one request reached the provider: {seen:?}");
    assert_eq!(seen[0].idempotency_key.as_deref(), Some("order-charge-42"));
    assert_eq!(
        seen[0].authorization.as_deref(),
        Some("Bearer sk_test_42"),
        "the secret comes from the host"
    );
    let token: u64 = seen[0].fencing_token.as_deref().unwrap().parse().unwrap();
    assert_eq!(j1["attempts"][0]["fencing_token"].as_u64(), Some(token));
    assert_eq!(j1["effects"][0]["outcome"], "performed");
    assert_eq!(j2["effects"][0]["outcome"], "replayed");
    assert_eq!(j2["effects"][0]["key"], "order-charge-42");
}

#[tokio::test]
async fn an_unknown_outcome_is_uncertain_under_skip_until_an_operator_resolves_it() {
    let (addr, hits) = servers::black_hole().await;
    let config = charge_queue(
        &format!("http://{addr}"),
        "",
        "max_attempts = 1\non_uncertain = \"skip\"",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;

    let id = d.enqueue("charge", order(7)).await;
    let j = d.wait_state(&id, "dead", 30).await;
    assert!(
        j["last_error"].as_str().unwrap().contains("uncertain"),
        "{j}"
    );
    assert_eq!(*hits.lock().unwrap(), 1, "the request left once");

    let (status, v) = d.call("GET", "/v1/fences?state=uncertain", None).await;
    assert_eq!(status, 200, "{v}");
    let fences = v["fences"].as_array().unwrap();
    assert_eq!(fences.len(), 1, "{v}");
    assert_eq!(
        (fences[0]["namespace"].as_str(), fences[0]["key"].as_str()),
        (Some("charge"), Some("order-charge-7"))
    );
    let out = d.cli(&["fences", "--state", "uncertain"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("order-charge-7"));

    // Retrying does not send it again: still uncertain.
    d.cli(&["retry", &id]);
    let j = d.wait_state(&id, "dead", 30).await;
    assert_eq!(j["attempts"].as_array().unwrap().len(), 2);
    assert_eq!(*hits.lock().unwrap(), 1, "skip: never more than once");

    // The operator says it happened: the next attempt replays.
    let out = d.cli(&[
        "fence",
        "resolve",
        "charge",
        "http",
        "order-charge-7",
        "done",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    d.cli(&["retry", &id]);
    let j = d.wait_state(&id, "completed", 30).await;
    assert_eq!(j["result"]["replayed"], true, "{j}");
    assert_eq!(*hits.lock().unwrap(), 1);
    let (_, v) = d.call("GET", "/v1/fences?state=uncertain", None).await;
    assert!(v["fences"].as_array().unwrap().is_empty());
}

#[tokio::test]
async fn on_uncertain_dead_and_repeat() {
    let (addr, hits) = servers::black_hole().await;
    let config = charge_queue(
        &format!("http://{addr}"),
        "",
        "max_attempts = 3\non_uncertain = \"dead\"",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let id = d.enqueue("charge", order(8)).await;
    let j = d.wait_state(&id, "dead", 30).await;
    assert_eq!(
        j["attempts"].as_array().unwrap().len(),
        1,
        "dead at once, whatever the budget: {j}"
    );
    assert!(
        j["last_error"].as_str().unwrap().contains("on_uncertain"),
        "{j}"
    );
    assert_eq!(*hits.lock().unwrap(), 1);

    let (addr, hits) = servers::black_hole().await;
    let config = charge_queue(
        &format!("http://{addr}"),
        "",
        "max_attempts = 1\non_uncertain = \"repeat\"",
    );
    let d = start(&config, &[("charge_customer", "charge_customer")]).await;
    let id = d.enqueue("charge", order(9)).await;
    d.wait_state(&id, "dead", 30).await;
    assert!(*hits.lock().unwrap() > 1, "repeat: at least once more");
}

#[tokio::test]
async fn welcome_email_is_sent_once_through_the_outbox() {
    let d = start(
        "[queues.welcome]\nplugin = \"welcome_email\"\nnamespace = \"users\"\ngrants = { kv = true, email = true }\n\
         [email]\ntransport = \"outbox\"\nfrom = \"hello@example.com\"\n",
        &[("welcome_email", "welcome_email")],
    )
    .await;
    let user = payload(json!({"user_id": 7, "email": "ada@example.com", "name": "Ada"}));
    let a = d.enqueue("welcome", user.clone()).await;
    let ja = d.wait_state(&a, "completed", 30).await;
    let b = d.enqueue("welcome", user).await;
    let jb = d.wait_state(&b, "completed", 30).await;
    assert_eq!(ja["result"]["replayed"], false);
    assert_eq!(jb["result"]["replayed"], true);
    assert_eq!(ja["result"]["message_id"], jb["result"]["message_id"]);
    let outbox: Vec<_> = std::fs::read_dir(d.dir.path().join("data/outbox"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "eml"))
        .collect();
    assert_eq!(outbox.len(), 1, "{outbox:?}");
    let mail = std::fs::read_to_string(&outbox[0]).unwrap();
    assert!(
        mail.contains("ada@example.com")
            && mail.contains(ja["result"]["message_id"].as_str().unwrap())
    );
}

#[tokio::test]
async fn welcome_email_over_real_smtp() {
    let tmp = tempfile::tempdir().unwrap();
    let smtp = Smtp::start(&tmp.path().join("mail"));
    let d = start(
        &format!(
            "[queues.welcome]\nplugin = \"welcome_email\"\ngrants = {{ kv = true, email = true }}\n\
             [email]\ntransport = \"smtp\"\nfrom = \"hello@example.com\"\nhost = \"127.0.0.1\"\nport = {}\ntls = \"none\"\n",
            smtp.port
        ),
        &[("welcome_email", "welcome_email")],
    )
    .await;
    let id = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 9, "email": "bob@example.com", "name": "Bob"})),
        )
        .await;
    let j = d.wait_state(&id, "completed", 30).await;
    let again = d
        .enqueue(
            "welcome",
            payload(json!({"user_id": 9, "email": "bob@example.com", "name": "Bob"})),
        )
        .await;
    d.wait_state(&again, "completed", 30).await;
    let messages = smtp.messages();
    assert_eq!(messages.len(), 1, "one message reached the SMTP server");
    assert!(
        messages[0].contains(j["result"]["message_id"].as_str().unwrap()),
        "{}",
        messages[0]
    );
    assert!(messages[0].contains("Welcome, Bob!"));
}

//! Figure 7: effects, durable. Jobs/s of `welcome_email` through the outbox
//! and through SMTP to a local aiosmtpd sink, of `charge_customer` against a
//! payments API served by this process, and the cost of the fence itself
//! (`fenced_cost`: one `Effects::http_send` against the bare
//! `Provider::send` of the same request).

use super::*;
pub async fn figure_effects(bench: &Bench, jobs: usize, calls: usize) -> anyhow::Result<Vec<Row>> {
    for guest in ["welcome_email", "charge_customer"] {
        let path = bench.plugins.join(format!("{guest}.wasm"));
        ensure!(
            path.is_file(),
            "{} is missing: build the guests with scripts/build-plugins",
            path.display()
        );
    }
    let n = thousands(jobs as f64);
    let mut rows = Vec::new();

    let outbox =
        format!("{WELCOME_QUEUE}[email]\ntransport = \"outbox\"\nfrom = \"bench@example.com\"\n");
    let rates = fresh_drains(
        bench,
        &outbox,
        "welcome",
        "welcome_email",
        jobs,
        welcome_payload,
    )
    .await?;
    note(format!("7a: welcome_email, outbox: {rates} jobs/s"));
    rows.push(Row::report(
        &format!("7a. welcome_email jobs/s, outbox ({n} due at once, concurrency 16)"),
        format!("{rates}"),
    ));

    match SmtpSink::start()? {
        Some(mut sink) => {
            let smtp = format!(
                "{WELCOME_QUEUE}[email]\ntransport = \"smtp\"\nfrom = \"bench@example.com\"\n\
                 host = \"127.0.0.1\"\nport = {}\ntls = \"none\"\n",
                sink.port
            );
            let sink_cpu = sink.cpu();
            let rates = fresh_drains(
                bench,
                &smtp,
                "welcome",
                "welcome_email",
                jobs,
                welcome_payload,
            )
            .await?;
            // The sink is part of what is measured, not other work on the
            // machine: take its CPU time out of the others' total.
            let sink_cpu = sink.cpu().minus(sink_cpu).total();
            if let Ok(mut others) = OTHERS.lock() {
                *others = (*others - sink_cpu).max(0.0);
            }
            let received = sink.received()?;
            note(format!(
                "   the SMTP sink used {sink_cpu:.2} CPU s, {:.2} ms per message (in \"rest of the machine\" above)",
                sink_cpu * 1e3 / received.max(1) as f64
            ));
            ensure!(
                received == RUNS * jobs,
                "the SMTP sink received {received} messages for {} jobs",
                RUNS * jobs
            );
            note(format!("7b: welcome_email, SMTP: {rates} jobs/s"));
            rows.push(Row::report(
                "7b. welcome_email jobs/s, SMTP to a local aiosmtpd sink",
                format!("{rates}"),
            ));
        }
        None => {
            note("7b: skipped: python3 with aiosmtpd is not available".into());
            rows.push(Row::report(
                "7b. welcome_email jobs/s, SMTP to a local aiosmtpd sink",
                "not measured (python3 -m pip install aiosmtpd)".into(),
            ));
        }
    }

    let payments = PaymentsServer::start().await?;
    let charge = format!(
        "[queues.charge]\nplugin = \"charge_customer\"\nconcurrency = 16\ngrants = {{ http = [\"payments\"] }}\n\
         [http.payments]\nbase_url = \"{}\"\nidempotency_header = \"Idempotency-Key\"\n",
        payments.url()
    );
    let rates = fresh_drains(
        bench,
        &charge,
        "charge",
        "charge_customer",
        jobs,
        charge_payload,
    )
    .await?;
    let charged = payments.requests();
    ensure!(
        charged == RUNS * jobs,
        "the payments server received {charged} charges for {} jobs",
        RUNS * jobs
    );
    note(format!("7c: charge_customer, HTTP: {rates} jobs/s"));
    rows.push(Row::report(
        "7c. charge_customer jobs/s, HTTP to a local payments API",
        format!("{rates}"),
    ));

    let cost = fenced_cost(bench, &payments, calls).await?;
    let extra = cost.fenced_p50.as_secs_f64() - cost.bare_p50.as_secs_f64();
    note(format!(
        "7d: {calls} calls each: fenced p50 {} p99 {}, bare p50 {} p99 {}",
        micros(cost.fenced_p50),
        micros(cost.fenced_p99),
        micros(cost.bare_p50),
        micros(cost.bare_p99),
    ));
    rows.push(Row::report(
        "7d. one fenced HTTP call over the bare call (p50, one at a time)",
        format!(
            "+{} ({} vs {})",
            micros(Duration::from_secs_f64(extra.max(0.0))),
            micros(cost.fenced_p50),
            micros(cost.bare_p50)
        ),
    ));
    Ok(rows)
}

pub(super) fn welcome_payload(i: usize) -> Value {
    json!({ "user_id": i, "email": format!("user{i}@example.com"), "name": format!("User {i}") })
}

pub(super) fn charge_payload(i: usize) -> Value {
    json!({ "order_id": i, "amount": 1250, "currency": "EUR", "customer": "cus_bench" })
}

/// Latencies of figure 7d.
struct FencedCost {
    fenced_p50: Duration,
    fenced_p99: Duration,
    bare_p50: Duration,
    bare_p99: Duration,
}

/// Times `calls` fenced HTTP calls (`Effects::http_send`, each by its own
/// leased job, with its own key) and as many bare ones (`Provider::send` of
/// the same provider), interleaved, one at a time, on a ledger of its own.
async fn fenced_cost(
    bench: &Bench,
    payments: &PaymentsServer,
    calls: usize,
) -> anyhow::Result<FencedCost> {
    let dir = bench.fresh_dir("fenced")?;
    let store: Arc<dyn Store> = Arc::new(SqliteStore::open(&dir)?);
    let provider = HttpProvider {
        name: "payments".into(),
        base_url: payments.url(),
        idempotency_header: Some("Idempotency-Key".into()),
        timeout: Duration::from_secs(10),
        headers: Default::default(),
        max_response: 1 << 20,
        reconcile: None,
    };
    let providers = Arc::new(
        Providers::from_config(&[("payments".to_owned(), provider)].into())
            .map_err(anyhow::Error::msg)?,
    );
    let scope = Arc::new(Scope {
        queue: "charge".into(),
        namespace: "charge".into(),
        grants: Grants {
            http: vec!["payments".into()],
            ..Grants::default()
        },
        on_uncertain: OnUncertain::Skip,
        mailer: Err("no email in this bench".into()),
        providers: providers.clone(),
        email_from: "bench@localhost".into(),
        clock: Arc::new(khata::clock::SystemClock),
    });
    let provider = providers.get("payments").context("no provider")?;

    let total = FENCED_WARM_UP + calls;
    for start in (0..total).step_by(BATCH) {
        let batch = (start..(start + BATCH).min(total))
            .map(|_| NewJob {
                queue: "charge".into(),
                id: None,
                payload: "{}".into(),
                priority: 0,
                run_at: Millis::now(),
                max_attempts: 1,
                dedup_key: None,
                dedup_for: None,
            })
            .collect();
        store.enqueue(batch, Millis::now()).await?;
    }
    let mut leases = Vec::with_capacity(total);
    while leases.len() < total {
        let ask = LeaseAsk {
            queue: "charge",
            max: 1_000,
            plugin_version: "bench",
            limits: LeaseLimits::default(),
        };
        let got = store.lease(&ask, Millis::now()).await?.leases;
        ensure!(!got.is_empty(), "leased {} of {total} jobs", leases.len());
        leases.extend(got);
    }

    let request = |i: usize| HttpRequest {
        method: "POST".into(),
        path: "/v1/charges".into(),
        headers: vec![("content-type".into(), "application/json".into())],
        body: Some(charge_payload(i).to_string().into_bytes()),
    };
    let mut bare = Vec::with_capacity(calls);
    let mut fenced = Vec::with_capacity(calls);
    for (i, lease) in leases.iter().enumerate() {
        let sent = Instant::now();
        let response = provider
            .send(&format!("bare-{i}"), lease.token, &request(i))
            .await
            .map_err(|e| anyhow::anyhow!("bare call: {e}"))?;
        let bare_took = sent.elapsed();
        ensure!(
            response.status == 200,
            "bare call answered {}",
            response.status
        );

        let effects = Effects::new(Arc::clone(&store), Arc::clone(&scope), lease.fence());
        let sent = Instant::now();
        let (response, replayed) = effects
            .http_send(&format!("fenced-{i}"), "payments", request(i))
            .await
            .map_err(|e| anyhow::anyhow!("fenced call: {e}"))?;
        let fenced_took = sent.elapsed();
        ensure!(
            response.status == 200 && !replayed,
            "fenced call answered {} (replayed: {replayed})",
            response.status
        );
        if i >= FENCED_WARM_UP {
            bare.push(bare_took);
            fenced.push(fenced_took);
        }
    }
    bare.sort_unstable();
    fenced.sort_unstable();
    let p = |v: &[Duration], q: usize| v[(v.len() * q / 100).min(v.len() - 1)];
    Ok(FencedCost {
        fenced_p50: p(&fenced, 50),
        fenced_p99: p(&fenced, 99),
        bare_p50: p(&bare, 50),
        bare_p99: p(&bare, 99),
    })
}

// ---------------------------------------------------------------------------
// Local providers (figure 7)

/// A payments API on 127.0.0.1, served by this process: `POST /v1/charges`
/// answers 200 with a charge for the order in the body, and counts requests.
pub(super) struct PaymentsServer {
    addr: std::net::SocketAddr,
    requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl PaymentsServer {
    pub(super) async fn start() -> anyhow::Result<PaymentsServer> {
        let requests = Arc::new(AtomicUsize::new(0));
        let app = axum::Router::new()
            .route("/v1/charges", axum::routing::post(charge))
            .with_state(Arc::clone(&requests));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                note(format!("the payments server stopped: {e}"));
            }
        });
        Ok(PaymentsServer {
            addr,
            requests,
            task,
        })
    }

    pub(super) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Charges received so far.
    pub(super) fn requests(&self) -> usize {
        self.requests.load(Ordering::Relaxed)
    }
}

/// `POST /v1/charges`: one more charge.
async fn charge(
    axum::extract::State(count): axum::extract::State<Arc<AtomicUsize>>,
    axum::Json(order): axum::Json<Value>,
) -> axum::Json<Value> {
    let n = count.fetch_add(1, Ordering::Relaxed) + 1;
    axum::Json(json!({
        "id": format!("ch_{n}"),
        "amount": order["amount"],
        "order_id": order["order_id"],
    }))
}

impl Drop for PaymentsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An SMTP server that accepts every message and keeps only a count:
/// aiosmtpd in a python3 child, as the tests use.
pub(super) struct SmtpSink {
    pub(super) port: u16,
    child: Child,
    stdin: std::process::ChildStdin,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

const SMTP_SINK: &str = r#"
import sys
from aiosmtpd.controller import Controller
class Count:
    received = 0
    async def handle_DATA(self, server, session, envelope):
        Count.received += 1
        return "250 OK"
c = Controller(Count(), hostname="127.0.0.1", port=int(sys.argv[1]))
c.start()
print("ready", flush=True)
for _ in sys.stdin:
    print(Count.received, flush=True)
"#;

impl SmtpSink {
    /// Starts the sink; `None` when python3 or aiosmtpd is missing.
    pub(super) fn start() -> anyhow::Result<Option<SmtpSink>> {
        use std::io::BufRead;
        let port = free_port()?;
        let spawned = Command::new("python3")
            .args(["-c", SMTP_SINK, &port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn();
        let Ok(mut child) = spawned else {
            return Ok(None);
        };
        let stdin = child.stdin.take().context("sink stdin")?;
        let mut stdout = std::io::BufReader::new(child.stdout.take().context("sink stdout")?);
        let mut line = String::new();
        stdout.read_line(&mut line)?;
        if line.trim() != "ready" {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(None);
        }
        Ok(Some(SmtpSink {
            port,
            child,
            stdin,
            stdout,
        }))
    }

    /// CPU time the sink used so far.
    pub(super) fn cpu(&self) -> Times {
        stat_times(&format!("/proc/{}/stat", self.child.id())).unwrap_or_default()
    }

    /// Messages received so far.
    pub(super) fn received(&mut self) -> anyhow::Result<usize> {
        use std::io::{BufRead, Write};
        self.stdin.write_all(b"count\n")?;
        self.stdin.flush()?;
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        line.trim()
            .parse()
            .with_context(|| format!("the SMTP sink said {line:?}"))
    }
}

impl Drop for SmtpSink {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

//! Real servers on 127.0.0.1 for the effects tests: a payments API that
//! deduplicates by idempotency key (as Stripe does), a push API that does not
//! (every request is one more notification), a server that takes a request
//! and drops the connection without answering, and an SMTP server (aiosmtpd,
//! from PyPI) that saves every message it receives, and can drop the
//! connection after a message instead of answering it.

#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::{Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{Value, json};
use tokio::io::AsyncReadExt;

/// One request the payments or push server received.
#[derive(Clone, Debug)]
pub struct Seen {
    pub idempotency_key: Option<String>,
    pub fencing_token: Option<String>,
    pub authorization: Option<String>,
    pub body: Value,
}

/// How the payments server answers.
#[derive(Clone, Debug)]
pub struct Behaviour {
    /// How long each charge takes to answer (after it is recorded).
    pub delay: Duration,
    /// How long the first charge takes to answer, instead of `delay`.
    pub first_delay: Option<Duration>,
    /// The status of every charge's answer.
    pub status: StatusCode,
}

impl Default for Behaviour {
    fn default() -> Behaviour {
        Behaviour {
            delay: Duration::ZERO,
            first_delay: None,
            status: StatusCode::OK,
        }
    }
}

#[derive(Default)]
struct Ledger {
    behaviour: Behaviour,
    requests: Vec<Seen>,
    /// Charges by idempotency key (or by request number without one).
    charges: HashMap<String, Value>,
    /// Charge requests received and not yet answered (or dropped).
    in_flight: usize,
    /// The most `in_flight` ever was.
    max_in_flight: usize,
}

/// Counts one charge request in flight from its arrival until it is
/// answered or its connection dropped.
struct InFlight(Arc<Mutex<Ledger>>);

impl InFlight {
    fn enter(ledger: &Arc<Mutex<Ledger>>) -> InFlight {
        let mut l = ledger.lock().unwrap();
        l.in_flight += 1;
        l.max_in_flight = l.max_in_flight.max(l.in_flight);
        InFlight(Arc::clone(ledger))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Ok(mut l) = self.0.lock() {
            l.in_flight -= 1;
        }
    }
}

/// A payments API: `POST /v1/charges` creates a charge, once per
/// `Idempotency-Key`; `GET /v1/charges?key=` looks one up.
#[derive(Clone)]
pub struct Payments {
    pub addr: SocketAddr,
    ledger: Arc<Mutex<Ledger>>,
}

fn header(h: &HeaderMap, name: &str) -> Option<String> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::to_owned)
}

async fn charge(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let _in_flight = InFlight::enter(&ledger);
    // The charge is made when the request arrives; the answer may be slow.
    let (status, charge, delay) = {
        let mut l = ledger.lock().unwrap();
        let key = header(&headers, "idempotency-key");
        l.requests.push(Seen {
            idempotency_key: key.clone(),
            fencing_token: header(&headers, "khata-fencing-token"),
            authorization: header(&headers, "authorization"),
            body: body.clone(),
        });
        let n = l.requests.len();
        let key = key.unwrap_or_else(|| format!("request-{n}"));
        let charge = l
            .charges
            .entry(key)
            .or_insert_with(|| json!({"id": format!("ch_{n}"), "amount": body["amount"], "order_id": body["order_id"]}))
            .clone();
        let b = &l.behaviour;
        let delay = if n == 1 {
            b.first_delay.unwrap_or(b.delay)
        } else {
            b.delay
        };
        (b.status, charge, delay)
    };
    tokio::time::sleep(delay).await;
    (status, Json(charge))
}

async fn lookup(
    State(ledger): State<Arc<Mutex<Ledger>>>,
    Query(q): Query<HashMap<String, String>>,
) -> (StatusCode, Json<Value>) {
    let l = ledger.lock().unwrap();
    // A charge is found by its idempotency key, or by the merchant's
    // reference `order-charge-<order_id>` taken from its body.
    let by_reference = |k: &String| {
        l.requests
            .iter()
            .position(|r| format!("order-charge-{}", r.body["order_id"]) == *k)
            .and_then(|i| {
                l.charges.get(
                    &l.requests[i]
                        .idempotency_key
                        .clone()
                        .unwrap_or_else(|| format!("request-{}", i + 1)),
                )
            })
    };
    match q
        .get("key")
        .and_then(|k| l.charges.get(k).or_else(|| by_reference(k)))
    {
        Some(c) => (StatusCode::OK, Json(c.clone())),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({"error": "no such charge"})),
        ),
    }
}

impl Payments {
    pub async fn start() -> Payments {
        Self::start_with(Behaviour::default()).await
    }

    /// A server that takes `delay` to answer each charge.
    pub async fn start_with_delay(delay: Duration) -> Payments {
        Self::start_with(Behaviour {
            delay,
            ..Behaviour::default()
        })
        .await
    }

    pub async fn start_with(behaviour: Behaviour) -> Payments {
        let ledger = Arc::new(Mutex::new(Ledger {
            behaviour,
            ..Ledger::default()
        }));
        let app = Router::new()
            .route("/v1/charges", post(charge).get(lookup))
            .with_state(Arc::clone(&ledger));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Payments { addr, ledger }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<Seen> {
        self.ledger.lock().unwrap().requests.clone()
    }

    /// Requests whose body names this order.
    pub fn requests_for(&self, order_id: u64) -> usize {
        self.requests()
            .iter()
            .filter(|r| r.body["order_id"] == order_id)
            .count()
    }

    /// Charges created (distinct idempotency keys).
    pub fn charges(&self) -> usize {
        self.ledger.lock().unwrap().charges.len()
    }

    /// The most charge requests that were in flight at once.
    pub fn max_in_flight(&self) -> usize {
        self.ledger.lock().unwrap().max_in_flight
    }
}

/// A push API: `POST /v1/push` delivers a notification on every request,
/// however often the same one comes (it does not deduplicate), and answers
/// 200 `{"delivered": true}`.
#[derive(Clone)]
pub struct Push {
    pub addr: SocketAddr,
    requests: Arc<Mutex<Vec<Seen>>>,
}

async fn push(
    State(requests): State<Arc<Mutex<Vec<Seen>>>>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> Json<Value> {
    requests.lock().unwrap().push(Seen {
        idempotency_key: header(&headers, "idempotency-key"),
        fencing_token: header(&headers, "khata-fencing-token"),
        authorization: header(&headers, "authorization"),
        body,
    });
    Json(json!({"delivered": true}))
}

impl Push {
    pub async fn start() -> Push {
        let requests = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new()
            .route("/v1/push", post(push))
            .with_state(Arc::clone(&requests));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        Push { addr, requests }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every `POST /v1/push` received, in order: one notification each.
    pub fn requests(&self) -> Vec<Seen> {
        self.requests.lock().unwrap().clone()
    }
}

/// Accepts connections, reads a request, and closes without answering:
/// the client cannot know whether the request took effect.
pub async fn black_hole() -> (SocketAddr, Arc<Mutex<usize>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let count = Arc::new(Mutex::new(0usize));
    let seen = Arc::clone(&count);
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let mut buf = vec![0u8; 65536];
            let mut got = Vec::new();
            while let Ok(n) = sock.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
                if got.windows(4).any(|w| w == b"\r\n\r\n") {
                    break;
                }
            }
            *seen.lock().unwrap() += 1;
            drop(sock);
        }
    });
    (addr, count)
}

/// An aiosmtpd server that saves each message as a file in `dir`.
pub struct Smtp {
    pub port: u16,
    pub dir: PathBuf,
    child: Child,
}

/// What the SMTP server does once it has received a whole message (the
/// body and its final dot, after `DATA`) and saved it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterData {
    /// Answers `250 OK`.
    Answer,
    /// For the first `n` messages it receives, closes the connection
    /// without a reply to the final dot; answers the later ones.
    DropFirst(u32),
    /// Closes the connection without a reply after every message.
    DropAlways,
}

const SMTP_SINK: &str = r#"
import asyncio, sys, time, pathlib, uuid
from aiosmtpd.controller import Controller
DELAY = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
# How many messages to keep and then drop the connection on, unanswered; -1: all.
DROP = int(sys.argv[4]) if len(sys.argv) > 4 else 0
class Save:
    dropped = 0
    async def handle_DATA(self, server, session, envelope):
        out = pathlib.Path(sys.argv[2])
        name = out / (uuid.uuid4().hex + ".eml")
        tmp = out / ("." + name.name + ".tmp")
        tmp.write_bytes(envelope.original_content or envelope.content)
        tmp.rename(name)
        if DROP < 0 or Save.dropped < DROP:
            Save.dropped += 1
            # The message is kept; the client never hears so.
            server.transport.abort()
            # aiosmtpd cancels this handler when it sees the connection lost.
            await asyncio.Event().wait()
        await asyncio.sleep(DELAY)
        return "250 OK"
c = Controller(Save(), hostname="127.0.0.1", port=int(sys.argv[1]))
c.start()
print("ready", flush=True)
while True:
    time.sleep(3600)
"#;

impl Smtp {
    /// Starts the server; panics with a clear message when aiosmtpd is missing.
    pub fn start(dir: &Path) -> Smtp {
        Self::start_with(dir, Duration::ZERO, AfterData::Answer)
    }

    /// A server that takes `delay` to answer each message after keeping it.
    pub fn start_with_delay(dir: &Path, delay: Duration) -> Smtp {
        Self::start_with(dir, delay, AfterData::Answer)
    }

    /// A server that keeps each message and then acts as `after_data` says.
    pub fn start_with(dir: &Path, delay: Duration, after_data: AfterData) -> Smtp {
        let drop = match after_data {
            AfterData::Answer => 0,
            AfterData::DropFirst(n) => i64::from(n),
            AfterData::DropAlways => -1,
        };
        let port = crate::support::free_port();
        std::fs::create_dir_all(dir).unwrap();
        let mut child = Command::new("python3")
            .args(["-c", SMTP_SINK, &port.to_string()])
            .arg(dir)
            .arg(delay.as_secs_f64().to_string())
            .arg(drop.to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                break;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!(
                    "the SMTP test server exited ({status}); is aiosmtpd installed? (python3 -m pip install aiosmtpd)"
                );
            }
            assert!(
                Instant::now() < deadline,
                "the SMTP test server did not start"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Smtp {
            port,
            dir: dir.to_owned(),
            child,
        }
    }

    /// Every message the server kept (whether or not it answered).
    pub fn messages(&self) -> Vec<String> {
        let mut out = Vec::new();
        for e in std::fs::read_dir(&self.dir).unwrap() {
            let path = e.unwrap().path();
            if path.extension().is_some_and(|x| x == "eml") {
                out.push(std::fs::read_to_string(path).unwrap());
            }
        }
        out
    }
}

impl Drop for Smtp {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

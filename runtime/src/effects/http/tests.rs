use super::*;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const MIB: usize = 1024 * 1024;

/// One request as the test server saw it.
#[derive(Clone, Debug)]
struct Seen {
    method: String,
    path: String,
    /// Names lower-cased.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A small HTTP/1.1 server on 127.0.0.1, one request per connection.
///
/// Routes (under an optional `/api` prefix): `/ok` 200 JSON, `/fail` 500,
/// `/redirect` 302 to another host, `/big` 3 MiB with a length,
/// `/big-stream` 3 MiB delimited by close, `/slow` answers after 2 s,
/// `/slow-body` sends headers then stalls, `/drop` closes without an
/// answer, `/charges/known` 200, `/charges/missing` 404, other
/// `/charges/...` 500.
struct Server {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    async fn start() -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve_one(stream, log.clone()));
            }
        });
        Server { addr, seen }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn serve_one(mut stream: TcpStream, seen: Arc<Mutex<Vec<Seen>>>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at;
        }
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
    let mut lines = head.split("\r\n");
    let mut request_line = lines.next().unwrap_or("").split(' ');
    let method = request_line.next().unwrap_or("").to_owned();
    let path = request_line.next().unwrap_or("").to_owned();
    let headers: Vec<(String, String)> = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let length: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < length {
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    seen.lock().unwrap().push(Seen {
        method,
        path: path.clone(),
        headers,
        body,
    });

    let route = path.strip_prefix("/api").unwrap_or(&path);
    let route = route.split('?').next().unwrap_or("");
    let answer = |status: &str, extra: &str, body: &[u8]| {
        let mut out = format!(
            "HTTP/1.1 {status}\r\nconnection: close\r\ncontent-length: {}\r\n{extra}\r\n",
            body.len()
        )
        .into_bytes();
        out.extend_from_slice(body);
        out
    };
    let response = match route {
        "/ok" => answer(
            "200 OK",
            "content-type: application/json\r\nx-reply: yes\r\n",
            br#"{"ok":true}"#,
        ),
        "/fail" => answer("500 Internal Server Error", "", b"boom"),
        "/redirect" => answer("302 Found", "location: http://evil.example/\r\n", b""),
        "/big" => answer("200 OK", "", &vec![b'x'; 3 * MIB]),
        "/big-stream" => {
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
                .await;
            for _ in 0..3 * 16 {
                if stream.write_all(&[b'y'; MIB / 16]).await.is_err() {
                    return;
                }
            }
            return;
        }
        "/slow" => {
            tokio::time::sleep(Duration::from_secs(2)).await;
            answer("200 OK", "", b"late")
        }
        "/slow-body" => {
            let _ = stream
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nab")
                .await;
            tokio::time::sleep(Duration::from_secs(2)).await;
            return;
        }
        "/drop" => return,
        "/charges/known" => answer(
            "200 OK",
            "content-type: application/json\r\n",
            br#"{"id":"ch_1"}"#,
        ),
        "/charges/missing" => answer("404 Not Found", "", b""),
        _ if route.starts_with("/charges/") => answer("500 Internal Server Error", "", b""),
        _ => answer("404 Not Found", "", b"no route"),
    };
    let _ = stream.write_all(&response).await;
    let _ = stream.shutdown().await;
}

fn config(name: &str, base_url: &str) -> HttpProvider {
    HttpProvider {
        name: name.to_owned(),
        base_url: base_url.to_owned(),
        idempotency_header: None,
        timeout: Duration::from_secs(5),
        headers: BTreeMap::new(),
        max_response: MIB as u64,
        reconcile: None,
    }
}

fn provider(config: HttpProvider) -> Providers {
    let mut map = BTreeMap::new();
    map.insert(config.name.clone(), config);
    Providers::from_config(&map).unwrap()
}

fn request(method: &str, path: &str) -> HttpRequest {
    HttpRequest {
        method: method.to_owned(),
        path: path.to_owned(),
        headers: Vec::new(),
        body: None,
    }
}

/// An environment variable that is set while tests run, and its value
/// (tests may not set one: that is `unsafe` in this edition).
fn some_env_var() -> (String, String) {
    ["CARGO_PKG_NAME", "CARGO_MANIFEST_DIR", "PATH", "HOME"]
        .iter()
        .find_map(|var| {
            std::env::var(var)
                .ok()
                .filter(|v| !v.is_empty() && HeaderValue::from_str(v).is_ok())
                .map(|v| ((*var).to_owned(), v))
        })
        .expect("some environment variable is set")
}

#[tokio::test]
async fn configured_headers_token_and_key_arrive() {
    let server = Server::start().await;
    let dir = tempfile::tempdir().unwrap();
    let secret_file: PathBuf = dir.path().join("key");
    std::fs::write(&secret_file, "from-a-file\n").unwrap();
    let (var, var_value) = some_env_var();

    let mut cfg = config("pay", &format!("{}/api/", server.url()));
    cfg.idempotency_header = Some("Idempotency-Key".into());
    cfg.headers.insert(
        "Authorization".into(),
        Secret::Plain("Bearer s3cret".into()),
    );
    cfg.headers.insert(
        "X-Env".into(),
        Secret::Env {
            var: var.clone(),
            prefix: "env:".into(),
        },
    );
    cfg.headers.insert(
        "X-File".into(),
        Secret::File {
            path: secret_file,
            prefix: String::new(),
        },
    );
    let providers = provider(cfg);
    let pay = providers.get("pay").unwrap();
    assert_eq!(pay.name(), "pay");
    assert!(pay.idempotent());
    assert!(providers.get("other").is_none());

    let req = HttpRequest {
        method: "POST".into(),
        path: "/ok?x=1".into(),
        headers: vec![
            ("X-Guest".into(), "g1".into()),
            ("Content-Type".into(), "application/json".into()),
            ("x-guest".into(), "g2".into()),
        ],
        body: Some(br#"{"amount":5}"#.to_vec()),
    };
    let response = pay.send("order-1", 42, &req).await.unwrap();
    assert_eq!(response.status, 200);
    assert_eq!(response.body, br#"{"ok":true}"#);
    assert!(
        response
            .headers
            .contains(&("x-reply".to_owned(), "yes".to_owned()))
    );

    let seen = server.seen();
    assert_eq!(seen.len(), 1);
    let got = &seen[0];
    assert_eq!(got.method, "POST");
    assert_eq!(got.path, "/api/ok?x=1");
    assert_eq!(got.body, br#"{"amount":5}"#);
    assert_eq!(got.header("authorization"), Some("Bearer s3cret"));
    assert_eq!(
        got.header("x-env"),
        Some(format!("env:{var_value}").as_str())
    );
    assert_eq!(got.header("x-file"), Some("from-a-file"));
    assert_eq!(got.header("khata-fencing-token"), Some("42"));
    assert_eq!(got.header("idempotency-key"), Some("order-1"));
    assert_eq!(got.header("content-type"), Some("application/json"));
    let guest: Vec<&str> = got
        .headers
        .iter()
        .filter(|(n, _)| n == "x-guest")
        .map(|(_, v)| v.as_str())
        .collect();
    assert_eq!(guest, ["g1", "g2"]);

    // No idempotency header on a provider without one.
    let plain = provider(config("plain", &server.url()));
    let plain = plain.get("plain").unwrap();
    assert!(!plain.idempotent());
    plain.send("k", 7, &request("GET", "/ok")).await.unwrap();
    let got = server.seen().pop().unwrap();
    assert_eq!(got.path, "/ok");
    assert_eq!(got.header("khata-fencing-token"), Some("7"));
    assert_eq!(got.header("idempotency-key"), None);
}

#[tokio::test]
async fn guest_cannot_set_host_headers() {
    let server = Server::start().await;
    let mut cfg = config("pay", &server.url());
    cfg.idempotency_header = Some("Idempotency-Key".into());
    cfg.headers.insert(
        "Authorization".into(),
        Secret::Plain("Bearer s3cret".into()),
    );
    let providers = provider(cfg);
    let pay = providers.get("pay").unwrap();

    for name in [
        "Host",
        "content-length",
        "Transfer-Encoding",
        "CONNECTION",
        "Khata-Fencing-Token",
        "idempotency-key",
        "Authorization",
        "upgrade",
    ] {
        let mut req = request("POST", "/ok");
        req.headers = vec![("X-Fine".into(), "1".into()), (name.into(), "evil".into())];
        let err = pay.validate(&req).unwrap_err();
        let HttpError::Invalid(message) = &err else {
            panic!("{name}: {err:?}")
        };
        assert!(
            message.starts_with(&format!("headers[1] {name:?}: ")),
            "{message}"
        );
        assert_eq!(pay.send("k", 1, &req).await.unwrap_err(), err);
    }
    assert!(server.seen().is_empty(), "nothing may be sent");

    let mut ok = request("GET", "/ok");
    ok.headers = vec![("X-Fine".into(), "1".into())];
    pay.validate(&ok).unwrap();
}

#[tokio::test]
async fn bad_requests_are_refused_and_nothing_is_sent() {
    let server = Server::start().await;
    let providers = provider(config("p", &format!("{}/api", server.url())));
    let p = providers.get("p").unwrap();

    let bad_paths = [
        "",
        "ok",
        "http://evil.example/x",
        "https://evil.example",
        "//evil.example",
        "//evil.example/x",
        "/../x",
        "/api/../../x",
        "/..",
        "/a/./b",
        "/%2e%2e/x",
        "/%2E%2e/x",
        "/a/..%2Fb",
        "/a/%252e%252e/b",
        "/a\\..\\b",
        "/\\evil.example",
        "/x\r\nHost: evil.example",
        "/x\n",
        "/x#frag",
        "/x\0",
    ];
    for path in bad_paths {
        let err = p.validate(&request("GET", path)).unwrap_err();
        match &err {
            HttpError::Invalid(m) if m.starts_with("path: ") => {}
            other => panic!("{path:?}: {other:?}"),
        }
        assert_eq!(
            p.send("k", 1, &request("GET", path)).await.unwrap_err(),
            err
        );
    }

    for method in ["get", "CONNECT", "TRACE", "OPTIONS", "", "G ET"] {
        match p.validate(&request(method, "/ok")).unwrap_err() {
            HttpError::Invalid(m) if m.starts_with("method: ") => {}
            other => panic!("{method:?}: {other:?}"),
        }
    }

    for (name, value) in [
        ("Bad Name", "v"),
        ("", "v"),
        ("X-A", "a\r\nX-B: b"),
        ("X-A", "\0"),
    ] {
        let mut req = request("GET", "/ok");
        req.headers = vec![(name.into(), value.into())];
        match p.validate(&req).unwrap_err() {
            HttpError::Invalid(m) if m.starts_with(&format!("headers[0] {name:?}: ")) => {}
            other => panic!("{name:?}: {other:?}"),
        }
        assert!(matches!(
            p.send("k", 1, &req).await,
            Err(HttpError::Invalid(_))
        ));
    }
    assert!(server.seen().is_empty(), "nothing may be sent");

    for path in [
        "/ok",
        "/a/b..c/.d",
        "/search?q=../x",
        "/a//b",
        "/caf\u{e9}",
        "/x?next=http://evil.example",
    ] {
        p.validate(&request("GET", path))
            .unwrap_or_else(|e| panic!("{path:?}: {e}"));
    }
    let response = p
        .send("k", 1, &request("GET", "/x?next=http://evil.example"))
        .await
        .unwrap();
    assert_eq!(response.status, 404);
    assert_eq!(server.seen()[0].path, "/api/x?next=http://evil.example");
}

#[tokio::test]
async fn any_status_is_a_response_and_redirects_are_not_followed() {
    let server = Server::start().await;
    let providers = provider(config("p", &server.url()));
    let p = providers.get("p").unwrap();

    let response = p.send("k", 1, &request("PUT", "/fail")).await.unwrap();
    assert_eq!(response.status, 500);
    assert_eq!(response.body, b"boom");

    let response = p.send("k", 1, &request("GET", "/redirect")).await.unwrap();
    assert_eq!(response.status, 302);
    assert!(
        response
            .headers
            .contains(&("location".to_owned(), "http://evil.example/".to_owned()))
    );
    assert_eq!(server.seen().len(), 2);

    let response = p.send("k", 1, &request("HEAD", "/ok")).await.unwrap();
    assert_eq!(response.status, 200);
    assert!(response.body.is_empty());
}

#[tokio::test]
async fn oversize_response_is_too_large() {
    let server = Server::start().await;
    let providers = provider(config("p", &server.url()));
    let p = providers.get("p").unwrap();
    for path in ["/big", "/big-stream"] {
        match p.send("k", 1, &request("GET", path)).await {
            Err(HttpError::TooLarge(_)) => {}
            other => panic!("{path}: {other:?}"),
        }
    }

    let mut cfg = config("roomy", &server.url());
    cfg.max_response = 4 * MIB as u64;
    let providers = provider(cfg);
    let roomy = providers.get("roomy").unwrap();
    for (path, byte) in [("/big", b'x'), ("/big-stream", b'y')] {
        let response = roomy.send("k", 1, &request("GET", path)).await.unwrap();
        assert_eq!(response.body.len(), 3 * MIB, "{path}");
        assert!(response.body.iter().all(|&b| b == byte));
    }
}

#[tokio::test]
async fn connect_refused_is_not_sent() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let providers = provider(config("gone", &format!("http://{addr}")));
    let gone = providers.get("gone").unwrap();
    match gone.send("k", 1, &request("POST", "/ok")).await {
        Err(HttpError::NotSent(_)) => {}
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn failed_tls_handshakes_are_not_sent() {
    // A peer that answers a ClientHello with plain text, and one that
    // accepts and never answers: the handshake fails, or times out
    // within the connect timeout; no request was written.
    let garbage = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let garbage_addr = garbage.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = garbage.accept().await {
            let _ = stream.write_all(b"HTTP/1.1 400 Bad Request\r\n\r\n").await;
        }
    });
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });

    for addr in [garbage_addr, silent_addr] {
        let mut cfg = config("tls", &format!("https://{addr}"));
        cfg.timeout = Duration::from_millis(400);
        let providers = provider(cfg);
        match providers
            .get("tls")
            .unwrap()
            .send("k", 1, &request("POST", "/ok"))
            .await
        {
            Err(HttpError::NotSent(_)) => {}
            other => panic!("{addr}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn timeouts_and_dropped_connections_are_unknown() {
    let server = Server::start().await;
    let mut cfg = config("p", &server.url());
    cfg.timeout = Duration::from_millis(300);
    let providers = provider(cfg);
    let p = providers.get("p").unwrap();

    for path in ["/slow", "/slow-body", "/drop"] {
        let started = std::time::Instant::now();
        match p.send("k", 1, &request("POST", path)).await {
            Err(HttpError::Unknown(_)) => {}
            other => panic!("{path}: {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_millis(1500), "{path}");
    }
    // Each of them reached the server.
    let paths: Vec<String> = server.seen().into_iter().map(|s| s.path).collect();
    assert_eq!(paths, ["/slow", "/slow-body", "/drop"]);
}

#[tokio::test]
async fn reconcile_asks_the_provider() {
    let server = Server::start().await;
    let mut cfg = config("pay", &server.url());
    cfg.idempotency_header = Some("Idempotency-Key".into());
    cfg.headers.insert(
        "Authorization".into(),
        Secret::Plain("Bearer s3cret".into()),
    );
    cfg.reconcile = Some(Reconcile {
        method: "GET".into(),
        path: "/charges/{key}".into(),
    });
    let providers = provider(cfg);
    let pay = providers.get("pay").unwrap();

    let found = pay.reconcile("known", 9).await.unwrap().unwrap().unwrap();
    assert_eq!(found.status, 200);
    assert_eq!(found.body, br#"{"id":"ch_1"}"#);
    let got = server.seen().pop().unwrap();
    assert_eq!(got.method, "GET");
    assert_eq!(got.path, "/charges/known");
    assert_eq!(got.header("authorization"), Some("Bearer s3cret"));
    assert_eq!(got.header("khata-fencing-token"), Some("9"));

    assert_eq!(pay.reconcile("missing", 9).await, Some(Ok(None)));

    match pay.reconcile("a b/c?d", 9).await {
        Some(Err(HttpError::Unknown(_))) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(server.seen().pop().unwrap().path, "/charges/a%20b%2Fc%3Fd");

    // A key cannot lead elsewhere.
    let before = server.seen().len();
    for key in ["..", "."] {
        match pay.reconcile(key, 9).await {
            Some(Err(HttpError::Invalid(_))) => {}
            other => panic!("{key:?}: {other:?}"),
        }
    }
    assert_eq!(server.seen().len(), before);

    // No reconcile configured: nothing to ask.
    let plain = provider(config("plain", &server.url()));
    assert_eq!(
        plain.get("plain").unwrap().reconcile("known", 1).await,
        None
    );

    // An unreachable provider: still unknown, as an error.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let mut cfg = config("gone", &format!("http://{addr}"));
    cfg.reconcile = Some(Reconcile {
        method: "GET".into(),
        path: "/charges?key={key}".into(),
    });
    let gone = provider(cfg);
    match gone.get("gone").unwrap().reconcile("k", 1).await {
        Some(Err(HttpError::NotSent(_))) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn secrets_are_resolved_when_built() {
    let missing_var = "KHATA_TEST_SURELY_UNSET_HTTP_5d1c";
    let mut cfg = config("pay", "https://api.example.com");
    cfg.headers.insert(
        "X-Key".into(),
        Secret::Env {
            var: missing_var.into(),
            prefix: String::new(),
        },
    );
    let mut map = BTreeMap::new();
    map.insert("pay".to_owned(), cfg);
    let err = Providers::from_config(&map).unwrap_err();
    assert!(err.starts_with("http.pay.headers.X-Key: "), "{err}");
    assert!(err.contains(missing_var), "{err}");

    let mut cfg = config("pay", "https://api.example.com");
    cfg.headers.insert(
        "X-Key".into(),
        Secret::File {
            path: "/nonexistent/khata/http-secret".into(),
            prefix: String::new(),
        },
    );
    map.insert("pay".to_owned(), cfg);
    let err = Providers::from_config(&map).unwrap_err();
    assert!(err.starts_with("http.pay.headers.X-Key: "), "{err}");
    assert!(err.contains("/nonexistent/khata/http-secret"), "{err}");

    // A value that cannot be a header value names its source, not itself.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad");
    std::fs::write(&file, "line one\nline two\n").unwrap();
    let mut cfg = config("pay", "https://api.example.com");
    cfg.headers.insert(
        "X-Key".into(),
        Secret::File {
            path: file.clone(),
            prefix: String::new(),
        },
    );
    map.insert("pay".to_owned(), cfg);
    let err = Providers::from_config(&map).unwrap_err();
    assert!(err.starts_with("http.pay.headers.X-Key: "), "{err}");
    assert!(err.contains(&file.display().to_string()), "{err}");
    assert!(!err.contains("line one"), "{err}");

    // The values stay out of Debug.
    let (var, value) = some_env_var();
    let mut cfg = config("pay", "https://api.example.com");
    cfg.headers.insert(
        "Authorization".into(),
        Secret::Plain("Bearer s3cret".into()),
    );
    cfg.headers.insert(
        "X-Env".into(),
        Secret::Env {
            var,
            prefix: "zz-prefix-".into(),
        },
    );
    map.insert("pay".to_owned(), cfg);
    let providers = Providers::from_config(&map).unwrap();
    let debug = format!("{providers:?}");
    assert!(debug.contains("Authorization") || debug.contains("authorization"));
    assert!(!debug.contains("s3cret"), "{debug}");
    assert!(!debug.contains(&format!("zz-prefix-{value}")), "{debug}");
}

#[test]
fn bad_provider_configs_name_the_key() {
    type Edit = fn(&mut HttpProvider);
    let cases: [(&str, Edit); 6] = [
        ("http.p.base_url", |c| c.base_url = "ftp://x.example".into()),
        ("http.p.base_url", |c| {
            c.base_url = "https://x.example/api?v=1".into()
        }),
        ("http.p.base_url", |c| {
            c.base_url = "https://user:pw@x.example".into()
        }),
        ("http.p.idempotency_header", |c| {
            c.idempotency_header = Some("Bad Header".into())
        }),
        ("http.p.headers.Host", |c| {
            c.headers.insert("Host".into(), Secret::Plain("x".into()));
        }),
        ("http.p.reconcile.path", |c| {
            c.reconcile = Some(Reconcile {
                method: "GET".into(),
                path: "//evil.example/{key}".into(),
            })
        }),
    ];
    for (key, edit) in cases {
        let mut cfg = config("p", "https://x.example");
        edit(&mut cfg);
        let mut map = BTreeMap::new();
        map.insert("p".to_owned(), cfg);
        let err = Providers::from_config(&map).unwrap_err();
        assert!(err.starts_with(&format!("{key}: ")), "{key}: {err}");
    }
}

#[test]
fn canonical_form() {
    let providers = provider(config("p", "https://api.example.com"));
    let p = providers.get("p").unwrap();
    let a = HttpRequest {
        method: "POST".into(),
        path: "/v1/charges".into(),
        headers: vec![
            ("X-B".into(), "2".into()),
            ("Content-Type".into(), "application/json".into()),
            ("X-A".into(), "1".into()),
        ],
        body: Some(b"{\"amount\":5}".to_vec()),
    };
    let mut b = a.clone();
    b.headers = vec![
        ("x-a".into(), "1".into()),
        ("X-B".into(), "2".into()),
        ("content-type".into(), "application/json".into()),
    ];
    assert_eq!(p.canonical(&a), p.canonical(&b));

    let mut other_body = a.clone();
    other_body.body = Some(b"{\"amount\":6}".to_vec());
    assert_ne!(p.canonical(&a), p.canonical(&other_body));
    let mut no_body = a.clone();
    no_body.body = None;
    let mut empty_body = a.clone();
    empty_body.body = Some(Vec::new());
    assert_ne!(p.canonical(&no_body), p.canonical(&empty_body));

    let mut other_value = a.clone();
    other_value.headers[0].1 = "3".into();
    assert_ne!(p.canonical(&a), p.canonical(&other_value));
    let mut other_path = a.clone();
    other_path.path = "/v1/refunds".into();
    assert_ne!(p.canonical(&a), p.canonical(&other_path));
    let mut other_method = a.clone();
    other_method.method = "PUT".into();
    assert_ne!(p.canonical(&a), p.canonical(&other_method));

    // Repeated headers keep their order.
    let mut twice = a.clone();
    twice.headers = vec![("X-R".into(), "1".into()), ("X-R".into(), "2".into())];
    let mut swapped = a.clone();
    swapped.headers = vec![("X-R".into(), "2".into()), ("X-R".into(), "1".into())];
    assert_ne!(p.canonical(&twice), p.canonical(&swapped));

    // Another provider, another request.
    let q = provider(config("q", "https://api.example.com"));
    assert_ne!(p.canonical(&a), q.get("q").unwrap().canonical(&a));
}

#[test]
fn response_serializes_body_as_base64() {
    let response = HttpResponse {
        status: 201,
        headers: vec![("content-type".into(), "text/plain".into())],
        body: vec![0, 159, 146, 150],
    };
    let json = serde_json::to_value(&response).unwrap();
    assert_eq!(json["body"], "AJ+Slg==");
    assert_eq!(json["status"], 201);
    let back: HttpResponse = serde_json::from_value(json).unwrap();
    assert_eq!(back, response);
}

#[test]
fn percent_helpers() {
    assert_eq!(percent_encode("a-b_c.d~e"), "a-b_c.d~e");
    assert_eq!(percent_encode("a b/c?é"), "a%20b%2Fc%3F%C3%A9");
    assert_eq!(percent_decode(b"%2e%2E%zz%4"), b"..%zz%4");
    assert_eq!(percent_decode_fully(b"%252e"), b".");
}

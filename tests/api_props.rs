//! Random requests at every route (issue 19): random methods, paths with
//! random segments and query strings, random bytes or random JSON as the
//! body, random content types and extra headers. Whatever arrives, the
//! daemon answers (never a closed connection), never with a 5xx, every
//! error carries the JSON error body, and a refused request stores nothing.

use crate::support;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{Value, json};
use support::Daemon;

/// One random request.
#[derive(Debug, Clone)]
struct Request {
    method: &'static str,
    path: String,
    content_type: Option<&'static str>,
    header: Option<(String, String)>,
    body: Vec<u8>,
}

/// A path segment: a real name, or random text percent-encoded.
fn segment() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("echo".to_owned()),
        Just("no-such".to_owned()),
        "[a-zA-Z0-9._~:-]{0,12}",
        proptest::collection::vec(any::<u8>(), 0..12).prop_map(|bytes| {
            bytes
                .iter()
                .map(|b| format!("%{b:02X}"))
                .collect::<String>()
        }),
    ]
}

fn path() -> impl Strategy<Value = String> {
    let query = prop_oneof![
        Just(String::new()),
        "(limit|state|queue|cursor|namespace|x)=[a-z0-9%]{0,8}".prop_map(|q| format!("?{q}")),
        "[ -~]{0,20}".prop_map(|q| format!("?{}", q.replace(['#', ' '], ""))),
    ];
    let route = (segment(), segment()).prop_flat_map(|(a, b)| {
        prop_oneof![
            Just(format!("/v1/queues/{a}/jobs")),
            Just(format!("/v1/queues/{a}/jobs/batch")),
            Just("/v1/jobs".to_owned()),
            Just(format!("/v1/jobs/{a}")),
            Just(format!("/v1/jobs/{a}/retry")),
            Just("/v1/fences".to_owned()),
            Just("/v1/fences/resolve".to_owned()),
            Just("/v1/queues".to_owned()),
            Just("/v1/schedules".to_owned()),
            Just(format!("/v1/index/{a}/{b}")),
            Just("/metrics".to_owned()),
            Just("/healthz".to_owned()),
            Just("/".to_owned()),
            Just(format!("/{a}/{b}")),
        ]
    });
    (route, query).prop_map(|(r, q)| format!("{r}{q}"))
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(Value::from),
        ".{0,16}".prop_map(Value::from),
        prop_oneof![
            Just("payload"),
            Just("id"),
            Just("dedup_key"),
            Just("delay"),
            Just("run_at"),
            Just("max_attempts"),
            Just("jobs"),
        ]
        .prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    Just("payload".to_owned()),
                    Just("id".to_owned()),
                    Just("jobs".to_owned()),
                    Just("delay".to_owned()),
                    Just("max_attempts".to_owned()),
                    Just("namespace".to_owned()),
                    Just("outcome".to_owned()),
                    "[a-z_]{1,8}",
                ],
                inner,
                0..6
            )
            .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn request() -> impl Strategy<Value = Request> {
    let method = prop_oneof![
        Just("GET"),
        Just("POST"),
        Just("POST"),
        Just("DELETE"),
        Just("PUT"),
        Just("PATCH"),
    ];
    let content_type = prop_oneof![
        Just(Some("application/json")),
        Just(Some("application/json")),
        Just(Some("text/plain")),
        Just(Some("application/x-www-form-urlencoded")),
        Just(None),
    ];
    let header = prop_oneof![
        Just(None),
        ("(origin|host|authorization|x-[a-z]{1,6})", "[!-~]{0,24}").prop_map(|(k, v)| Some((k, v))),
    ];
    let body = prop_oneof![
        Just(Vec::new()),
        proptest::collection::vec(any::<u8>(), 0..256),
        json_value().prop_map(|v| v.to_string().into_bytes()),
        json_value().prop_map(|v| json!({"payload": v}).to_string().into_bytes()),
        json_value().prop_map(|v| json!({"jobs": [{"payload": v}]}).to_string().into_bytes()),
    ];
    (method, path(), content_type, header, body).prop_map(
        |(method, path, content_type, header, body)| Request {
            method,
            path,
            content_type,
            header,
            body,
        },
    )
}

/// Jobs in the ledger, every queue and state.
async fn stored(d: &Daemon) -> u64 {
    let (status, v) = d.call("GET", "/v1/queues", None).await;
    assert_eq!(status, 200, "{v}");
    v["queues"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|q| q["counts"].as_object().unwrap().values())
        .map(|n| n.as_u64().unwrap_or(0))
        .sum()
}

#[test]
fn random_requests_never_break_the_api() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let d = rt.block_on(Daemon::start_new(
        "[queues.echo]\nplugin = \"absent\"\nmax_payload = \"4KiB\"\n",
        &[],
    ));
    let http = support::client();
    let mut runner = TestRunner::new(Config {
        cases: 400,
        failure_persistence: None,
        ..Config::default()
    });
    runner
        .run(&request(), |r| {
            rt.block_on(async {
                let before = stored(&d).await;
                let method = reqwest::Method::from_bytes(r.method.as_bytes()).unwrap();
                let mut req = http
                    .request(method, format!("{}{}", d.url, r.path))
                    .body(r.body.clone());
                if let Some(t) = r.content_type {
                    req = req.header("content-type", t);
                }
                if let Some((k, v)) = &r.header {
                    req = req.header(k.as_str(), v.as_str());
                }
                let resp = req
                    .send()
                    .await
                    .map_err(|e| TestCaseError::fail(format!("no answer: {e}")))?;
                let status = resp.status().as_u16();
                let kind = resp
                    .headers()
                    .get("content-type")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let text = resp
                    .text()
                    .await
                    .map_err(|e| TestCaseError::fail(format!("body cut: {e}")))?;
                prop_assert!(status < 500, "{status}: {text}");
                if status >= 400 {
                    prop_assert!(
                        kind.starts_with("application/json"),
                        "{status} {kind}: {text}"
                    );
                    let v: Value = serde_json::from_str(&text)
                        .map_err(|e| TestCaseError::fail(format!("{status} {text}: {e}")))?;
                    prop_assert!(v["error"]["code"].is_string(), "{v}");
                    prop_assert!(v["error"]["message"].is_string(), "{v}");
                    prop_assert_eq!(stored(&d).await, before, "a {} stored something", status);
                }
                let (health, _) = d.call("GET", "/healthz", None).await;
                prop_assert_eq!(health, 200);
                Ok(())
            })
        })
        .unwrap();
}

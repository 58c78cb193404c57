use std::time::Duration;

use super::{describe, parse_url, with_defaults};

/// The variable that names the test server: a URL of a database on it
/// where the user may `CREATE DATABASE`.
pub const ENV: &str = "KHATA_TEST_PG_URL";

/// The admin URL, or a panic that says how to start a server: the
/// PostgreSQL tests fail, never skip, when there is none.
pub fn admin_url() -> String {
    match std::env::var(ENV) {
        Ok(url) if !url.trim().is_empty() => url,
        _ => panic!(
            "{ENV} is not set, and the PostgreSQL tests need a server. Start a throwaway one \
             (initdb in a temporary directory, a free port of 127.0.0.1) with\n\n    \
             eval \"$(scripts/pg-test-server start)\"\n\nand stop it afterwards with \
             `scripts/pg-test-server stop \"$KHATA_TEST_PG_DIR\"` (scripts/test does both), \
             or set {ENV} to a server where this user may CREATE DATABASE, e.g. \
             postgres://postgres@127.0.0.1:5432/postgres"
        ),
    }
}

/// A database made for one test, dropped (with its connections) when
/// this is dropped.
#[derive(Debug)]
pub struct TestDatabase {
    admin: String,
    /// The database's name.
    pub name: String,
    /// A URL of this database (from the admin URL, another database name).
    pub url: String,
}

impl TestDatabase {
    /// Creates an empty database with a unique name.
    pub async fn create() -> TestDatabase {
        let admin = admin_url();
        let name = format!("khata_test_{}", uuid::Uuid::now_v7().simple());
        let cfg = with_defaults(parse_url(&admin).expect("KHATA_TEST_PG_URL"));
        let (client, connection) = cfg.connect(tokio_postgres::NoTls).await.unwrap_or_else(|e| {
            panic!(
                "cannot connect to the test server {ENV}={admin}: {}\nIs it running? Start one with: eval \"$(scripts/pg-test-server start)\"",
                describe(&e)
            )
        });
        let task = tokio::spawn(connection);
        client
            .batch_execute(&format!(
                "CREATE DATABASE {name} TEMPLATE template0 ENCODING 'UTF8'"
            ))
            .await
            .unwrap_or_else(|e| panic!("CREATE DATABASE {name}: {}", describe(&e)));
        drop(client);
        let _ = task.await;
        let url = url_with_dbname(&admin, &name);
        TestDatabase { admin, name, url }
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let (admin, name) = (self.admin.clone(), self.name.clone());
        // Drop runs inside the test's runtime: use a thread of its own.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            rt.block_on(async move {
                let cfg = with_defaults(parse_url(&admin).ok()?);
                let (client, connection) = cfg.connect(tokio_postgres::NoTls).await.ok()?;
                let task = tokio::spawn(connection);
                let sql = format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)");
                let r =
                    tokio::time::timeout(Duration::from_secs(30), client.batch_execute(&sql)).await;
                drop(client);
                let _ = task.await;
                r.ok()?.ok()
            })
        });
        let _ = dropped.join();
    }
}

/// `url` with its database replaced by `dbname`: the path of a
/// `postgres://` URL, or a `dbname=` pair appended to a key-value string.
pub fn url_with_dbname(url: &str, dbname: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return format!("{url} dbname={dbname}");
    };
    let rest_start = scheme_end + 3;
    let (base, query) = match url.find('?') {
        Some(q) => (&url[..q], &url[q..]),
        None => (url, ""),
    };
    let base = match base[rest_start..].find('/') {
        Some(slash) => &base[..rest_start + slash],
        None => base,
    };
    format!("{base}/{dbname}{query}")
}

#[test]
fn dbname_is_replaced() {
    assert_eq!(
        url_with_dbname("postgres://u:p@127.0.0.1:5/postgres", "t"),
        "postgres://u:p@127.0.0.1:5/t"
    );
    assert_eq!(
        url_with_dbname("postgresql://h:5?sslmode=disable", "t"),
        "postgresql://h:5/t?sslmode=disable"
    );
    assert_eq!(
        url_with_dbname("host=h port=5", "t"),
        "host=h port=5 dbname=t"
    );
}

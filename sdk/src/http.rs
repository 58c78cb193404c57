//! Requests to named HTTP providers, once per idempotency key.
//!
//! A request names a provider from `jobs.toml` (`[http.NAME]`), never a URL:
//! the daemon joins the provider's base URL and path, adds its configured
//! headers (secrets stay in the daemon), an idempotency header carrying the key
//! where the provider has one, and a `Khata-Fencing-Token` header. The queue
//! needs the `http` grant for the provider.
//!
//! The daemon records the response to each key: sending again with the same key
//! and request replays it (with `replayed` set) and sends nothing. A response
//! of any status is recorded, as Stripe records a 500, so [`send`] returns
//! `Ok` for a 4xx or 5xx too, and retrying with the same key sees the same
//! response; check [`Response::is_success`].
//!
//! ```no_run
//! use khata_sdk::prelude::*;
//!
//! # fn handle(job: Job) -> Result<(), Error> {
//! let body = serde_json::json!({ "amount": 1200, "currency": "eur" });
//! let request = http::post("payments", "/v1/charges").json(&body)?;
//! let response = http::send("order-charge-42", request)?;
//! if !response.is_success() {
//!     return Err(Error::fail(format!("charge refused: {}", response.status)));
//! }
//! let charge: serde_json::Value = response.json()?;
//! # Ok(()) }
//! ```

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::bindings::khata::plugin::http as wit;
use crate::{EffectError, Error};

/// An HTTP request to a named provider; build one with [`request`] or the
/// method functions ([`get`], [`post`], …) and the methods below.
pub use crate::bindings::khata::plugin::http::Request;

/// The provider's response, as received or as replayed from the ledger.
pub use crate::bindings::khata::plugin::http::Response;

/// Sends `request` once for `key`.
pub fn send(key: impl AsRef<str>, request: Request) -> Result<Response, EffectError> {
    wit::send(key.as_ref(), &request)
}

/// A request with any method to `path` on `provider`.
pub fn request(
    provider: impl Into<String>,
    method: impl Into<String>,
    path: impl Into<String>,
) -> Request {
    Request {
        provider: provider.into(),
        method: method.into(),
        path: path.into(),
        headers: Vec::new(),
        body: None,
    }
}

/// A `GET` request to `path` on `provider`.
pub fn get(provider: impl Into<String>, path: impl Into<String>) -> Request {
    request(provider, "GET", path)
}

/// A `POST` request to `path` on `provider`.
pub fn post(provider: impl Into<String>, path: impl Into<String>) -> Request {
    request(provider, "POST", path)
}

/// A `PUT` request to `path` on `provider`.
pub fn put(provider: impl Into<String>, path: impl Into<String>) -> Request {
    request(provider, "PUT", path)
}

/// A `PATCH` request to `path` on `provider`.
pub fn patch(provider: impl Into<String>, path: impl Into<String>) -> Request {
    request(provider, "PATCH", path)
}

/// A `DELETE` request to `path` on `provider`.
pub fn delete(provider: impl Into<String>, path: impl Into<String>) -> Request {
    request(provider, "DELETE", path)
}

impl Request {
    /// Adds a header.
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = Some(body.into());
        self
    }

    /// Sets the body to `value` as JSON, and `Content-Type: application/json`
    /// unless a content type is set already.
    pub fn json<T: Serialize + ?Sized>(mut self, value: &T) -> Result<Self, Error> {
        self.body = Some(serde_json::to_vec(value)?);
        if !self
            .headers
            .iter()
            .any(|(name, _)| name.eq_ignore_ascii_case("content-type"))
        {
            self.headers
                .push(("content-type".into(), "application/json".into()));
        }
        Ok(self)
    }
}

impl Response {
    /// True for a 2xx status.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The first value of header `name` (ignoring case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as UTF-8 text; a body that is not UTF-8 is [`Error::Fail`].
    pub fn text(&self) -> Result<&str, Error> {
        std::str::from_utf8(&self.body)
            .map_err(|e| Error::fail(format!("the response body is not UTF-8: {e}")))
    }

    /// The body parsed as JSON into `T`; a body that does not parse is
    /// [`Error::Fail`].
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_slice(&self.body)
            .map_err(|e| Error::fail(format!("the response body is not the expected JSON: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_sets_the_body_and_a_content_type() {
        let request = post("payments", "/v1/charges")
            .header("x-trace", "1")
            .json(&serde_json::json!({ "amount": 5 }))
            .unwrap();
        assert_eq!(request.method, "POST");
        assert_eq!(request.body.as_deref(), Some(&br#"{"amount":5}"#[..]));
        assert!(
            request
                .headers
                .contains(&("content-type".into(), "application/json".into()))
        );
    }
}

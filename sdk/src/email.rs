//! Sending email, once per idempotency key.
//!
//! The daemon sends through its configured transport (SMTP, or an outbox
//! directory of `.eml` files) and records each key: sending again with the same
//! key and message replays the recorded [`Receipt`] (with `replayed` set) and
//! sends nothing. The Message-ID is derived from the key, so that receivers can
//! drop a repeat too. The queue needs the `email` grant.
//!
//! SMTP is not idempotent: if the daemon died mid-send, whether the mail left is
//! unknown, and the queue's `on_uncertain` policy decides (by default the call
//! returns [`EffectError::Uncertain`] and the mail is not sent again).
//!
//! ```no_run
//! use khata_sdk::prelude::*;
//!
//! # fn handle(job: Job) -> Result<(), Error> {
//! let message = email::Message::new("Welcome!", "Hello Ada, and welcome.")
//!     .to("ada@example.com")
//!     .html("<p>Hello Ada, and welcome.</p>");
//! let receipt = email::send("welcome:7", &message)?;
//! # Ok(()) }
//! ```

use crate::EffectError;
use crate::bindings::khata::plugin::email as wit;

/// An email message; build one with [`Message::new`] and the methods below.
/// Without a sender, the daemon's configured `from` address is used.
pub use crate::bindings::khata::plugin::email::Message;

/// What the daemon recorded for a sent message: its Message-ID, and whether
/// this call replayed an earlier send.
pub use crate::bindings::khata::plugin::email::Receipt;

/// Sends `message` once for `key`.
pub fn send(key: impl AsRef<str>, message: &Message) -> Result<Receipt, EffectError> {
    wit::send(key.as_ref(), message)
}

impl Message {
    /// A plain-text message with no recipients yet.
    pub fn new(subject: impl Into<String>, text: impl Into<String>) -> Self {
        Message {
            to: Vec::new(),
            cc: Vec::new(),
            from: None,
            subject: subject.into(),
            text: text.into(),
            html: None,
        }
    }

    /// Adds a recipient.
    pub fn to(mut self, address: impl Into<String>) -> Self {
        self.to.push(address.into());
        self
    }

    /// Adds a copy recipient.
    pub fn cc(mut self, address: impl Into<String>) -> Self {
        self.cc.push(address.into());
        self
    }

    /// Sets the sender, instead of the daemon's configured one.
    pub fn from(mut self, address: impl Into<String>) -> Self {
        self.from = Some(address.into());
        self
    }

    /// Adds an HTML alternative to the text body.
    pub fn html(mut self, html: impl Into<String>) -> Self {
        self.html = Some(html.into());
        self
    }
}

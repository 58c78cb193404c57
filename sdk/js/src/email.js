// Sending email, once per idempotency key. The queue needs the `email` grant.
import * as wit from 'khata:plugin/email@0.1.0';
import { call } from './errors.js';

/** An email message; build with `new Message(subject, text).to(...)`. */
export class Message {
  constructor(subject, text) {
    this.subject = subject;
    this.text = text;
    this.toAddresses = [];
    this.ccAddresses = [];
    this.sender = undefined;
    this.htmlBody = undefined;
  }
  /** Adds a recipient. */
  to(address) {
    this.toAddresses.push(address);
    return this;
  }
  /** Adds a copy recipient. */
  cc(address) {
    this.ccAddresses.push(address);
    return this;
  }
  /** Sets the sender, instead of the daemon's configured one. */
  from(address) {
    this.sender = address;
    return this;
  }
  /** Adds an HTML alternative to the text body. */
  html(html) {
    this.htmlBody = html;
    return this;
  }
}

/** Sends `message` once for `key`: `{messageId, replayed}`. */
export function send(key, message) {
  return call(wit.send, key, {
    to: [...message.toAddresses],
    cc: [...message.ccAddresses],
    from: message.sender,
    subject: message.subject,
    text: message.text,
    html: message.htmlBody,
  });
}

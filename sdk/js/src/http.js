// Requests to named HTTP providers, once per idempotency key.
import * as wit from 'khata:plugin/http@0.1.0';
import { call, Fail } from './errors.js';

const encoder = new TextEncoder();

/** An HTTP request to a named provider; build with `post(...)` etc. */
export class Request {
  constructor(provider, method, path) {
    this.provider = provider;
    this.method = method;
    this.path = path;
    this.headers = [];
    this.body = undefined;
  }
  /** Adds a header. */
  header(name, value) {
    this.headers.push([name, value]);
    return this;
  }
  /** Sets the body (a Uint8Array, or a string sent as UTF-8). */
  withBody(body) {
    this.body = typeof body === 'string' ? encoder.encode(body) : body;
    return this;
  }
  /** Sets the body to `value` as JSON, and a JSON content type unless set. */
  json(value) {
    this.body = encoder.encode(JSON.stringify(value));
    if (!this.headers.some(([n]) => n.toLowerCase() === 'content-type')) {
      this.headers.push(['content-type', 'application/json']);
    }
    return this;
  }
}

/** The provider's response, as received or as replayed from the ledger. */
export class Response {
  constructor({ status, headers, body, replayed }) {
    this.status = status;
    this.headers = headers;
    this.body = body;
    this.replayed = replayed;
  }
  /** True for a 2xx status. */
  isSuccess() {
    return this.status >= 200 && this.status < 300;
  }
  /** The first value of header `name` (ignoring case), or undefined. */
  header(name) {
    const found = this.headers.find(([n]) => n.toLowerCase() === name.toLowerCase());
    return found ? found[1] : undefined;
  }
  /** The body as UTF-8 text; a body that is not UTF-8 is a `Fail`. */
  text() {
    try {
      return new TextDecoder('utf-8', { fatal: true }).decode(this.body);
    } catch (e) {
      throw new Fail(`the response body is not UTF-8: ${e.message}`);
    }
  }
  /** The body parsed as JSON; a body that does not parse is a `Fail`. */
  json() {
    try {
      return JSON.parse(this.text());
    } catch (e) {
      if (e instanceof Fail) throw e;
      throw new Fail(`the response body is not the expected JSON: ${e.message}`);
    }
  }
}

/** A request with any method to `path` on `provider`. */
export const request = (provider, method, path) => new Request(provider, method, path);
/** A GET request. */
export const get = (provider, path) => request(provider, 'GET', path);
/** A POST request. */
export const post = (provider, path) => request(provider, 'POST', path);
/** A PUT request. */
export const put = (provider, path) => request(provider, 'PUT', path);
/** A PATCH request. */
export const patch = (provider, path) => request(provider, 'PATCH', path);
/** A DELETE request. */
const del = (provider, path) => request(provider, 'DELETE', path);
export { del as delete };

/** Sends `request` once for `key`; the `Response` (any status). */
export function send(key, request) {
  const r = call(wit.send, key, {
    provider: request.provider,
    method: request.method,
    path: request.path,
    headers: request.headers.map(([n, v]) => [n, v]),
    body: request.body,
  });
  return new Response(r);
}

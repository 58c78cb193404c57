// Types of the khata JavaScript SDK. Handlers are ES modules built into
// components with `khata-build` (sdk/js/bin/khata-build.js).
//
//   import { handler, http, Fail } from 'khata-sdk';
//
//   export const handle = handler((job) => {
//     const order = job.payload();
//     const request = http.post('payments', '/v1/charges').json({ amount: order.amount });
//     const response = http.send(`order-charge-${order.order_id}`, request);
//     if (!response.isSuccess()) throw new Fail(`charge refused: ${response.status}`);
//     return { charge: response.json(), replayed: response.replayed };
//   });

/** Any value `JSON.stringify` turns into JSON. */
export type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

/** How a handler gives up on this attempt: throw a `Retry` or a `Fail`. */
export class JobError extends Error {
  /** `"retry"` or `"fail"`, as the WIT `job-error` names it. */
  readonly kind: 'retry' | 'fail';
  /** True for `Retry`. */
  isRetry(): boolean;
}
/**
 * Transient: the daemon backs off and delivers the job again, until its
 * `max_attempts` are used up.
 * @example throw new Retry('the inventory service is down');
 */
export class Retry extends JobError {}
/**
 * Permanent: the job goes to the dead-letter queue now.
 * @example throw new Fail(`amount must be positive, got ${amount}`);
 */
export class Fail extends JobError {}

/** The WIT names of the effect errors. */
export type EffectErrorKind =
  | 'denied'
  | 'key-reused'
  | 'in-progress'
  | 'fenced'
  | 'uncertain'
  | 'transient'
  | 'rejected'
  | 'invalid';

/**
 * Why the host did not perform an effect; thrown by every effect function as
 * one of its subclasses. Uncaught in a handler, it becomes a `Retry` when
 * another attempt can succeed (`InProgress`, `Transient`, `Fenced`) and a
 * `Fail` otherwise, with the message `effect <kind>: <message>`.
 * @example
 * try {
 *   email.send(key, message);
 * } catch (e) {
 *   if (e instanceof KeyReused) throw new Fail(`already welcomed: ${e.message}`);
 *   throw e;
 * }
 */
export class EffectError extends Error {
  readonly kind: EffectErrorKind;
  /** True for in-progress, transient and fenced. */
  isRetryable(): boolean;
  /** The `Retry` or `Fail` an uncaught effect error becomes. */
  toJobError(): JobError;
}
/** Not granted to this queue; only a change to jobs.toml helps. */
export class Denied extends EffectError {}
/** The key was done before with another request: a bug in the handler's keys. */
export class KeyReused extends EffectError {}
/** A live attempt holds this fence. */
export class InProgress extends EffectError {}
/** This attempt no longer holds the job's lease. */
export class Fenced extends EffectError {}
/** The outcome of an earlier try is unknown and the policy is skip: a person decides. */
export class Uncertain extends EffectError {}
/** The provider failed in a way that is safe to retry. */
export class Transient extends EffectError {}
/** The provider refused; retrying won't help. */
export class Rejected extends EffectError {}
/** The request itself is malformed. */
export class Invalid extends EffectError {}

/** One delivery of a job. */
export class Job {
  /** Stable across every retry. */
  readonly id: string;
  /** The queue the job was enqueued on. */
  readonly queue: string;
  /** This delivery's number: 1 on the first. */
  readonly attempt: number;
  /** How many deliveries the job gets before it is dead-lettered. */
  readonly maxAttempts: number;
  /** When the job was enqueued, in milliseconds since the Unix epoch. */
  readonly enqueuedAtMs: number;
  /** The payload as the JSON text that was enqueued. */
  readonly payloadText: string;
  constructor(fields: {
    id: string;
    queue: string;
    payload: string;
    attempt?: number;
    maxAttempts?: number;
    enqueuedAtMs?: number | bigint;
  });
  /** True when a `Retry` from this attempt dead-letters the job. */
  isLastAttempt(): boolean;
  /**
   * The payload parsed from JSON; with `check`, what `check` makes of it. A
   * payload that does not parse is a `Fail` ("bad payload: ...").
   * @example
   * const order = job.payload((p) => ({ id: field(p, 'order_id', 'integer') }));
   */
  payload(): any;
  payload<T>(check: (value: any) => T): T;
  /**
   * A job-scoped idempotency key, `<job-id>:<name>`: the same on every retry.
   * @example email.send(job.key('report'), message);
   */
  key(name: string): string;
}

/** The types `field` checks. */
export type FieldType = 'any' | 'string' | 'number' | 'integer' | 'boolean' | 'object' | 'array';

/**
 * Field `name` of payload object `value`, checked to be of `type`; a missing
 * field or a wrong type is a `Fail` naming the field.
 * @example const amount = field(payload, 'amount', 'integer');
 */
export function field(value: unknown, name: string, type?: FieldType): any;

/**
 * Makes `fn` the component's `handle`; export the result as `handle`. The
 * return value becomes the job's JSON result. A thrown `Retry` or `Fail`
 * ends the attempt so; an uncaught `EffectError` retries or fails as its kind
 * says; anything else fails the job. Handlers are synchronous.
 * @example export const handle = handler((job) => job.payload());
 */
export function handler(fn: (job: Job) => Json | void): (job: unknown) => string;

/** Key-value data in the queue's namespace (the `kv` grant). */
export namespace kv {
  /** The value at `key`, or undefined. @example const v = kv.get('order:count'); */
  function get(key: string): Uint8Array | undefined;
  /** The value at `key` parsed as JSON, or undefined; bad JSON is a `Fail`. */
  function getJson(key: string): any;
  /** Sets `key` (a string value is stored as UTF-8). @example kv.put('greeting', 'hello'); */
  function put(key: string, value: Uint8Array | string): void;
  /** Sets `key` to `value` as JSON text. */
  function putJson(key: string, value: Json): void;
  /**
   * Sets `key` only if it has no value: true when this call inserted it.
   * @example if (kv.insertIfAbsent(`seen:${job.id}`, '1')) { ... }
   */
  function insertIfAbsent(key: string, value: Uint8Array | string): boolean;
  /** Removes `key`: true when a value was deleted. */
  function del(key: string): boolean;
  export { del as delete };
}

/** What an upsert did. */
export type UpsertOutcome = 'inserted' | 'updated' | 'unchanged' | 'stale';

/** Versioned documents in named collections (the `index` grant per collection). */
export namespace index {
  /**
   * Stores `document` (JSON text) as `id` at `version`, unless a version at
   * least as new is stored.
   * @example index.upsert('products', 'p1', '{"name":"Tea"}', 1700000000000);
   */
  function upsert(collection: string, id: string, document: string, version: number | bigint): UpsertOutcome;
  /** `upsert` with `document` serialized as JSON. */
  function upsertJson(collection: string, id: string, document: Json, version: number | bigint): UpsertOutcome;
  /** True for inserted and updated. */
  function changed(outcome: UpsertOutcome): boolean;
  /** Removes `id` as of `version`: true when removed. */
  function remove(collection: string, id: string, version: number | bigint): boolean;
  /** The document as JSON text, or undefined. */
  function get(collection: string, id: string): string | undefined;
  /** The document parsed, or undefined; bad JSON is a `Fail`. */
  function getJson(collection: string, id: string): any;
}

/** Sending email once per key (the `email` grant). */
export namespace email {
  /**
   * An email message. Without a sender, the daemon's configured `from` is used.
   * @example new email.Message('Welcome!', 'Hello.').to('ada@example.com')
   */
  class Message {
    constructor(subject: string, text: string);
    subject: string;
    text: string;
    toAddresses: string[];
    ccAddresses: string[];
    sender: string | undefined;
    htmlBody: string | undefined;
    to(address: string): Message;
    cc(address: string): Message;
    from(address: string): Message;
    html(html: string): Message;
  }
  /** What the daemon recorded for a sent message. */
  interface Receipt {
    messageId: string;
    /** True when this call replayed an earlier send and sent nothing. */
    replayed: boolean;
  }
  /** Sends `message` once for `key`. @example email.send(`welcome:${userId}`, message); */
  function send(key: string, message: Message): Receipt;
}

/** Requests to named HTTP providers once per key (the `http` grant per provider). */
export namespace http {
  /** A request to a provider of jobs.toml (`[http.NAME]`), never a URL. */
  class Request {
    constructor(provider: string, method: string, path: string);
    provider: string;
    method: string;
    path: string;
    headers: [string, string][];
    body: Uint8Array | undefined;
    header(name: string, value: string): Request;
    withBody(body: Uint8Array | string): Request;
    /** Sets a JSON body and `content-type: application/json` unless set. */
    json(value: Json): Request;
  }
  /** The response, as received or as replayed from the ledger. */
  class Response {
    status: number;
    headers: [string, string][];
    body: Uint8Array;
    /** True when this call replayed a recorded response and sent nothing. */
    replayed: boolean;
    isSuccess(): boolean;
    header(name: string): string | undefined;
    /** The body as UTF-8; not UTF-8 is a `Fail`. */
    text(): string;
    /** The body parsed as JSON; bad JSON is a `Fail`. */
    json(): any;
  }
  function request(provider: string, method: string, path: string): Request;
  function get(provider: string, path: string): Request;
  function post(provider: string, path: string): Request;
  function put(provider: string, path: string): Request;
  function patch(provider: string, path: string): Request;
  function del(provider: string, path: string): Request;
  export { del as delete };
  /**
   * Sends `request` once for `key`; a response of any status is returned
   * (and recorded), so check `isSuccess()`.
   * @example http.send(`order-charge-${orderId}`, http.post('payments', '/v1/charges').json(body));
   */
  function send(key: string, request: Request): Response;
}

/** Log lines into the daemon's log, tagged with job and attempt; no grant needed. */
export namespace log {
  type Level = 'trace' | 'debug' | 'info' | 'warn' | 'error';
  /** @example log.log('warn', 'price went up'); */
  function log(level: Level, message: string): void;
  function trace(message: string): void;
  function debug(message: string): void;
  function info(message: string): void;
  function warn(message: string): void;
  function error(message: string): void;
}

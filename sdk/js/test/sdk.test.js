// Tests of the SDK's pure parts with Node's test runner (no host, no build):
// `npm test` in sdk/js.
import assert from 'node:assert/strict';
import { test } from 'node:test';

import { call, Fail, KeyReused, Retry, Transient } from '../src/errors.js';
import { field, Job } from '../src/job.js';
import { run } from '../src/handler.js';
import { usedInterfaces } from '../bin/khata-build.js';

const raw = (payload) => ({ id: 'j', queue: 'q', payload, attempt: 2, maxAttempts: 5, enqueuedAtMs: 7n });

test('results become JSON text and errors the WIT job-error', () => {
  assert.equal(run((job) => ({ a: job.payload().a, attempt: job.attempt }), raw('{"a":1}')), '{"a":1,"attempt":2}');
  const thrown = (fn) => {
    try {
      run(fn, raw('{}'));
    } catch (e) {
      return e;
    }
    assert.fail('no error');
  };
  assert.deepEqual(thrown(() => { throw new Retry('later'); }), { tag: 'retry', val: 'later' });
  assert.deepEqual(thrown(() => { throw new Fail('never'); }), { tag: 'fail', val: 'never' });
  assert.deepEqual(thrown(() => { throw new Transient('down'); }), { tag: 'retry', val: 'effect transient: down' });
  assert.deepEqual(thrown(() => { throw new KeyReused('other'); }), { tag: 'fail', val: 'effect key-reused: other' });
  assert.deepEqual(thrown(() => { throw new TypeError('x is undefined'); }), { tag: 'fail', val: 'unhandled TypeError: x is undefined' });
  assert.deepEqual(thrown(() => ({ n: 1n })).tag, 'fail');
});

test('a host err becomes the matching effect error', () => {
  const hostErr = () => {
    const e = new Error('component error');
    e.payload = { tag: 'key-reused', val: 'welcome:7 was sent with another message' };
    throw e;
  };
  assert.throws(() => call(hostErr), (e) => e instanceof KeyReused && e.kind === 'key-reused' && !e.isRetryable());
});

test('payload fields are checked by name and type', () => {
  const p = new Job(raw('{"amount": 5, "currency": "EUR"}')).payload();
  assert.equal(field(p, 'amount', 'integer'), 5);
  assert.throws(() => field(p, 'customer', 'string'), { message: 'bad payload: missing field `customer`' });
  assert.throws(() => field(p, 'currency', 'integer'), { message: 'bad payload: field `currency` must be an integer, got string "EUR"' });
  assert.throws(() => field([1], 'a'), { message: 'bad payload: expected an object, got an array' });
  assert.throws(() => new Job(raw('{nope')).payload(), (e) => e instanceof Fail && e.message.startsWith('bad payload: '));
  assert.equal(new Job(raw('{}')).key('report'), 'j:report');
  assert.equal(new Job(raw('{}')).enqueuedAtMs, 7);
});

test('the world imports what the bundle imports', () => {
  const code = `import { send } from "khata:plugin/http@0.1.0";\nimport * as x from 'khata:plugin/kv@0.1.0';\nimport "khata:plugin/types@0.1.0";`;
  assert.deepEqual([...usedInterfaces(code)].sort(), ['http', 'kv']);
});

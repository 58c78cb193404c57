// `charge_customer` in JavaScript: charges a customer for an order once,
// through the `payments` provider (the seed's pattern 3, a provider
// idempotency key). The twin of the Rust `plugins/charge_customer`: same
// payload, key, request and result.
//
// Grants: `http` for `payments`.
// Payload: {"order_id": 42, "amount": 1200, "currency": "eur", "customer": "cus_1"};
// `order_id` is a non-negative integer or a non-empty string, `amount` a
// positive integer in the currency's minor unit, `currency` a three-letter
// code, `customer` the provider's non-empty customer id.
// Result: {"order_id": 42, "status": 201, "charge": {...}, "replayed": false}.
//
// The charge is `POST /v1/charges` with the JSON body
// {"amount", "currency", "customer", "order_id"} (keys in this order, as the
// Rust twin writes them) and the idempotency key `order-charge-<order_id>`:
// derived from the order, not from the job or the attempt, so redeliveries
// and duplicate jobs for one order charge once.
//
// A payload that fails validation, a 4xx and a 5xx all fail the job: a 5xx
// is recorded under the key, so a retry would only replay it (see `settle`).
import { Fail, field, handler, http } from 'khata-sdk';

/** How much of a refusal's body goes into the error message, in characters. */
const BODY_EXCERPT_CHARS = 200;

export const handle = handler((job) => {
  const charge = job.payload(parse);
  const orderId = validate(charge);
  const body = {
    amount: charge.amount,
    currency: charge.currency,
    customer: charge.customer,
    order_id: charge.order_id,
  };
  const request = http.post('payments', '/v1/charges').json(body);
  const response = http.send(`order-charge-${orderId}`, request);
  return settle(charge.order_id, response);
});

/** The payload's fields, typed. */
export function parse(payload) {
  return {
    order_id: field(payload, 'order_id'),
    amount: field(payload, 'amount', 'integer'),
    currency: field(payload, 'currency', 'string'),
    customer: field(payload, 'customer', 'string'),
  };
}

/** Checks the payload; returns the order id as key text. */
export function validate(charge) {
  const id = charge.order_id;
  let orderId;
  if (typeof id === 'string' && id !== '') orderId = id;
  else if (Number.isSafeInteger(id) && id >= 0) orderId = String(id);
  else {
    throw new Fail(
      `bad payload: order_id must be a non-empty string or a non-negative integer, got ${JSON.stringify(id)}`,
    );
  }
  if (charge.amount <= 0) {
    throw new Fail(`bad payload: amount must be positive, got ${charge.amount}`);
  }
  if (!/^[A-Za-z]{3}$/.test(charge.currency)) {
    throw new Fail(
      `bad payload: currency must be a three-letter code, got ${JSON.stringify(charge.currency)}`,
    );
  }
  if (charge.customer === '') throw new Fail('bad payload: customer must not be empty');
  return orderId;
}

/** Turns the provider's response (fresh or replayed) into the job's outcome. */
export function settle(orderId, response) {
  const status = response.status;
  if (status >= 200 && status < 300) {
    let charge = null;
    try {
      charge = JSON.parse(new TextDecoder().decode(response.body));
    } catch {
      charge = null;
    }
    return { order_id: orderId, status, charge, replayed: response.replayed };
  }
  if (status >= 400 && status < 500) {
    throw new Fail(`payment refused: ${status} ${excerpt(response.body)}`);
  }
  if (status >= 500 && status < 600) {
    // The 5xx is recorded under this order's key: every retry would replay
    // it without reaching the provider. Only a person who has checked with
    // the provider whether the money moved can charge again.
    throw new Fail(
      `payment provider error: ${status} (recorded for this order's key, so a retry would ` +
        `replay it; check with the provider before charging again)`,
    );
  }
  throw new Fail(`payment provider answered an unexpected status: ${status}`);
}

/** The body as text, trimmed and cut to BODY_EXCERPT_CHARS characters. */
function excerpt(body) {
  return [...new TextDecoder().decode(body).trim()].slice(0, BODY_EXCERPT_CHARS).join('');
}

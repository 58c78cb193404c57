// khata's operator dashboard (docs/api.md#the-dashboard). It reads the daemon's JSON API,
// the same one the CLI uses, and polls it every two seconds.
//
// Everything the API returns is data, some of it written by users (job
// payloads, results, errors, keys): it goes into the page as text only
// (createElement and text nodes through `el`), never as markup, and never
// into an attribute that could load or run something.
'use strict';

const TOKEN_KEY = 'khata.token';
const POLL_MS = 2000;
const STATES = ['waiting', 'delayed', 'active', 'completed', 'dead', 'cancelled'];
const DEAD_LIMIT = 100;

// What the operator looks at: the jobs filter, the pages seen (a stack of
// cursors, null for the first page) and the job opened in the detail view.
const view = { queue: '', state: '', limit: 20, cursors: [null], job: null };
// The JSON each section was last drawn from, so that an unchanged section is
// not redrawn (a button being clicked is not replaced under the pointer).
const drawn = new Map();
let needToken = false;

class Unauthorized extends Error {}

const $ = (selector) => document.querySelector(selector);

// Builds an element. `props`: `class`, `text`, `on<event>` handlers, `href`
// (only fragments of this page), data-* and a few inert attributes; children
// are nodes or strings (which become text nodes).
const INERT = new Set(['id', 'title', 'type', 'colspan', 'datetime', 'role']);
function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') node.className = v;
    else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
    else if (k === 'href' && String(v).startsWith('#')) node.setAttribute('href', v);
    else if (k === 'disabled') node.disabled = true;
    else if (k.startsWith('data-') || INERT.has(k)) node.setAttribute(k, String(v));
    else throw new Error(`el: attribute ${k} is not allowed`);
  }
  for (const c of children.flat(Infinity)) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : String(c));
  }
  return node;
}

// Replaces the children of `node` (nothing for null, unlike replaceChildren).
function fill(node, ...children) {
  node.replaceChildren(...children.flat(Infinity).filter((c) => c !== undefined && c !== null && c !== false));
}

function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

// One API call; throws Unauthorized on 401 and Error with the API's message
// on any other failure.
async function api(method, path, body) {
  const headers = { Accept: 'application/json' };
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  const init = { method, headers, cache: 'no-store', credentials: 'omit' };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const resp = await fetch(path, init);
  if (resp.status === 401) {
    if (t) {
      sessionStorage.removeItem(TOKEN_KEY);
      throw new Unauthorized('The daemon refused that token. Type the right one.');
    }
    throw new Unauthorized('This daemon needs a token.');
  }
  let data = null;
  try {
    data = await resp.json();
  } catch (_) {
    // Not JSON: the status says enough.
  }
  if (!resp.ok) {
    const e = data && data.error;
    throw new Error(e ? `${e.code}: ${e.message}` : `HTTP ${resp.status} from ${path}`);
  }
  return data;
}

function fmtTime(s) {
  if (!s) return '—';
  return el('time', { datetime: s }, String(s).replace('T', ' ').replace(/\.\d+Z$/, 'Z'));
}

function json(v) {
  return JSON.stringify(v, null, 2);
}

function short(s, n) {
  s = String(s);
  return s.length > n ? `${s.slice(0, n)}…` : s;
}

function stateTag(state) {
  const known = STATES.includes(state);
  return el('span', { class: known ? `state state-${state}` : 'state' }, state);
}

function jobLink(id) {
  return el('a', { href: `#job/${encodeURIComponent(id)}`, class: 'job-link', 'data-job-link': id }, id);
}

function table(headings, rows, props) {
  return el('table', props,
    el('thead', {}, el('tr', {}, headings.map((h) => el('th', {}, h)))),
    el('tbody', {}, rows));
}

function empty(text) {
  return el('p', { class: 'empty' }, text);
}

// Draws `data` into a section with `fn` unless it is what is drawn already.
function draw(key, data, fn) {
  const text = JSON.stringify(data);
  if (drawn.get(key) === text) return;
  drawn.set(key, text);
  fn(data);
}

function setStatus(text, error) {
  const s = $('#status');
  s.textContent = text;
  s.classList.toggle('error', Boolean(error));
  $('#forget-token').hidden = !token();
}

function flash(text, error) {
  const f = $('#flash');
  f.textContent = text;
  f.classList.toggle('error', Boolean(error));
  f.hidden = false;
}

// --- sections ---------------------------------------------------------------

function drawQueues(queues) {
  const body = $('#queues .body');
  if (!queues.length) {
    fill(body, empty('No queues in jobs.toml.'));
  } else {
    const rows = [];
    for (const q of queues) {
      const title = q.sha256
        ? `sha256 ${q.sha256}\nloaded ${q.loaded_at}\ncode ${q.code}`
        : 'no version loaded';
      rows.push(el('tr', { 'data-queue': q.name },
        el('td', { class: 'name' }, q.name),
        el('td', {}, q.plugin),
        el('td', { class: 'version', title }, q.version || '—'),
        el('td', { class: 'num' }, q.concurrency),
        STATES.map((s) => {
          const n = (q.counts && q.counts[s]) || 0;
          return el('td', { class: n ? 'num' : 'num zero', 'data-state': s },
            el('button', { type: 'button', class: 'count', title: `show ${s} jobs of ${q.name}`, onclick: () => filterJobs(q.name, s) }, n));
        })));
      if (q.load_error) {
        rows.push(el('tr', { class: 'load-error', 'data-load-error': q.name },
          el('td', { colspan: 4 + STATES.length }, `plugin ${q.plugin}: `, q.load_error)));
      }
    }
    fill(body, table(['Queue', 'Plugin', 'Version', 'Concurrency', ...STATES], rows));
  }
}

// The jobs filter offers the queues of jobs.toml.
function drawQueueFilter(names) {
  const select = $('#filter-queue');
  const options = [el('option', {}, 'all')];
  options[0].value = '';
  for (const name of names) {
    const o = el('option', {}, name);
    o.value = name;
    options.push(o);
  }
  fill(select, ...options);
  select.value = view.queue;
}

function drawFences(fences) {
  const body = $('#fences .body');
  if (!fences.length) {
    fill(body, empty('None: the outcome of every effect is known.'));
    return;
  }
  const rows = fences.map((f) => el('tr', { 'data-namespace': f.namespace, 'data-kind': f.kind, 'data-key': f.key },
    el('td', {}, f.namespace),
    el('td', {}, f.kind),
    el('td', { class: 'key' }, f.key),
    el('td', {}, f.job_id ? jobLink(f.job_id) : '—'),
    el('td', { class: 'num' }, f.attempt ?? '—'),
    el('td', {}, fmtTime(f.updated_at)),
    el('td', { class: 'actions' },
      el('button', { type: 'button', class: 'resolve-done', onclick: () => resolve(f, 'done') }, 'Resolve done'),
      el('button', { type: 'button', class: 'resolve-not-done', onclick: () => resolve(f, 'not-done') }, 'Resolve not-done'))));
  fill(body, table(['Namespace', 'Kind', 'Key', 'Job', 'Attempt', 'Since', ''], rows));
}

function drawDead(page) {
  const body = $('#dead .body');
  if (!page.jobs.length) {
    fill(body, empty('No dead jobs.'));
    return;
  }
  const rows = page.jobs.map((j) => el('tr', { 'data-job': j.id },
    el('td', {}, jobLink(j.id)),
    el('td', {}, j.queue),
    el('td', { class: 'num attempts' }, `${j.attempt} of ${j.max_attempts}`),
    el('td', {}, fmtTime(j.finished_at)),
    el('td', { class: 'error-text' }, j.last_error ?? ''),
    el('td', { class: 'actions' },
      el('button', { type: 'button', class: 'retry', onclick: () => retry(j.id) }, 'Retry'))));
  fill(body, 
    table(['Job', 'Queue', 'Attempts', 'Died', 'Last error', ''], rows),
    page.next_cursor ? empty(`The ${DEAD_LIMIT} newest; filter the jobs below by state "dead" for all.`) : null);
}

function drawJobs({ page }) {
  const body = $('#jobs .body');
  if (!page.jobs.length) {
    fill(body, empty('No jobs here.'));
  } else {
    const rows = page.jobs.map((j) => el('tr', { 'data-job': j.id },
      el('td', {}, jobLink(j.id)),
      el('td', {}, j.queue),
      el('td', {}, stateTag(j.state)),
      el('td', { class: 'num' }, `${j.attempt} of ${j.max_attempts}`),
      el('td', {}, fmtTime(j.enqueued_at)),
      el('td', {}, el('code', { class: 'payload' }, short(JSON.stringify(j.payload), 160))),
      el('td', { class: 'error-text' }, j.last_error ? short(j.last_error, 160) : '')));
    fill(body, table(['Job', 'Queue', 'State', 'Attempt', 'Enqueued', 'Payload', 'Last error'], rows));
  }
  view.next = page.next_cursor;
  $('#first-page').disabled = view.cursors.length === 1;
  $('#prev-page').disabled = view.cursors.length === 1;
  $('#next-page').disabled = !page.next_cursor;
  $('#page-number').textContent = `page ${view.cursors.length}`;
}

function drawJob(j) {
  const section = $('#job');
  const body = $('#job .body');
  section.hidden = false;
  $('#job-title').textContent = view.job;
  if (j.error) {
    fill(body, el('p', { class: 'error-text' }, j.error));
    return;
  }
  const facts = [
    ['queue', j.queue], ['state', stateTag(j.state)], ['attempt', `${j.attempt} of ${j.max_attempts}`],
    ['priority', j.priority], ['dedup key', j.dedup_key ?? '—'], ['run at', fmtTime(j.run_at)],
    ['enqueued', fmtTime(j.enqueued_at)], ['finished', fmtTime(j.finished_at)],
    ['last error', j.last_error ?? '—'],
  ];
  const dl = el('dl', {}, facts.map(([k, v]) => [el('dt', {}, k), el('dd', { 'data-field': k }, v)]));
  const canRetry = j.state === 'dead' || j.state === 'cancelled';
  const attempts = j.attempts.length
    ? table(['Number', 'Outcome', 'Error', 'Started', 'Ended', 'Fencing token'],
      j.attempts.map((a) => el('tr', { 'data-attempt': a.number },
        el('td', { class: 'num' }, a.number),
        el('td', { class: 'outcome' }, a.outcome ?? 'running'),
        el('td', { class: 'error-text' }, a.error ?? ''),
        el('td', {}, fmtTime(a.started_at)),
        el('td', {}, fmtTime(a.ended_at)),
        el('td', { class: 'num' }, a.fencing_token))), { id: 'job-attempts' })
    : empty('No attempt yet.');
  const effects = j.effects.length
    ? table(['Attempt', 'Kind', 'Key', 'Outcome', 'At'],
      j.effects.map((e) => el('tr', { 'data-key': e.key },
        el('td', { class: 'num' }, e.attempt),
        el('td', {}, e.kind),
        el('td', { class: 'key' }, e.key),
        el('td', { class: 'outcome' }, e.outcome),
        el('td', {}, fmtTime(e.at)))), { id: 'job-effects' })
    : empty('No effects.');
  fill(body, 
    dl,
    canRetry ? el('p', {}, el('button', { type: 'button', class: 'retry', id: 'job-retry', onclick: () => retry(j.id) }, 'Retry')) : null,
    el('h3', {}, 'Payload'), el('pre', { id: 'job-payload' }, json(j.payload)),
    el('h3', {}, 'Result'), el('pre', { id: 'job-result' }, j.result === null ? '—' : json(j.result)),
    el('h3', {}, 'Attempts'), attempts,
    el('h3', {}, 'Effects'), effects);
}

function drawSchedules(schedules) {
  const body = $('#schedules .body');
  if (!schedules.length) {
    fill(body, empty('No schedules in jobs.toml.'));
    return;
  }
  const rows = schedules.map((s) => el('tr', { 'data-schedule': s.name },
    el('td', {}, s.name),
    el('td', {}, s.queue),
    el('td', {}, el('code', {}, s.cron)),
    el('td', {}, s.timezone ?? 'UTC'),
    el('td', {}, s.catch_up),
    el('td', { class: 'next-fire' }, fmtTime(s.next_fire)),
    el('td', {}, fmtTime(s.last_fire)),
    el('td', { class: 'error-text' }, s.last_error ?? '')));
  fill(body, table(['Name', 'Queue', 'Cron', 'Time zone', 'Catch-up', 'Next fire', 'Last fire', 'Last error'], rows));
}

// --- actions ----------------------------------------------------------------

async function act(call, done) {
  try {
    await call();
    flash(done, false);
  } catch (e) {
    if (e instanceof Unauthorized) askForToken(e.message);
    else flash(e.message, true);
  }
  tick();
}

function retry(id) {
  return act(() => api('POST', `v1/jobs/${encodeURIComponent(id)}/retry`, {}), `Job ${id} is back in waiting.`);
}

function resolve(f, outcome) {
  const meaning = outcome === 'done'
    ? 'DONE: it happened. Attempts from now on replay it and never perform it again.'
    : 'NOT DONE: it did not happen. The fence is released and the next attempt performs it.';
  const question = `Resolve the ${f.kind} effect "${f.key}" (namespace "${f.namespace}", job ${f.job_id}) as ${meaning}`;
  if (!window.confirm(question)) return undefined;
  return act(
    () => api('POST', 'v1/fences/resolve', { namespace: f.namespace, kind: f.kind, key: f.key, outcome }),
    `The ${f.kind} effect "${f.key}" is resolved as ${outcome}.`);
}

function filterJobs(queue, state) {
  view.queue = queue;
  view.state = state;
  view.cursors = [null];
  $('#filter-queue').value = queue;
  $('#filter-state').value = state;
  $('#jobs').scrollIntoView();
  tick();
}

// --- the token --------------------------------------------------------------

function askForToken(message) {
  needToken = true;
  drawn.clear();
  $('#main').hidden = true;
  $('#token-panel').hidden = false;
  $('#token-message').textContent = message;
  setStatus('waiting for a token', true);
  $('#token-input').focus();
}

function useToken(event) {
  event.preventDefault();
  const input = $('#token-input');
  const t = input.value.trim();
  if (!/^[\x20-\x7e]+$/.test(t)) {
    $('#token-message').textContent = 'A token is printable ASCII.';
    return;
  }
  sessionStorage.setItem(TOKEN_KEY, t);
  input.value = '';
  needToken = false;
  $('#token-panel').hidden = true;
  setStatus('checking the token…', false);
  tick();
}

// --- polling ----------------------------------------------------------------

async function refresh() {
  if (needToken) return;
  try {
    const q = new URLSearchParams({ limit: String(view.limit) });
    if (view.queue) q.set('queue', view.queue);
    if (view.state) q.set('state', view.state);
    const cursor = view.cursors[view.cursors.length - 1];
    if (cursor) q.set('cursor', cursor);
    const jobId = view.job;
    const [queues, fences, dead, jobs, schedules, job] = await Promise.all([
      api('GET', 'v1/queues'),
      api('GET', 'v1/fences?state=uncertain&limit=1000'),
      api('GET', `v1/jobs?state=dead&limit=${DEAD_LIMIT}`),
      api('GET', `v1/jobs?${q}`),
      api('GET', 'v1/schedules'),
      jobId === null
        ? null
        : api('GET', `v1/jobs/${encodeURIComponent(jobId)}`).catch((e) => {
          if (e instanceof Unauthorized) throw e;
          return { error: e.message };
        }),
    ]);
    $('#main').hidden = false;
    draw('queues', queues.queues, drawQueues);
    draw('queue-names', queues.queues.map((q) => q.name), drawQueueFilter);
    draw('fences', fences.fences, drawFences);
    draw('dead', dead, drawDead);
    draw('jobs', { view: [view.queue, view.state, view.limit, view.cursors], page: jobs }, drawJobs);
    draw('schedules', schedules.schedules, drawSchedules);
    if (jobId !== null && jobId === view.job) draw('job', job, drawJob);
    setStatus(`live · updated ${new Date().toLocaleTimeString()}`, false);
  } catch (e) {
    if (e instanceof Unauthorized) askForToken(e.message);
    else setStatus(`cannot read the daemon: ${e.message}`, true);
  }
}

// One refresh at a time; a refresh asked for during one runs right after it.
let timer = null;
let running = false;
let again = false;
async function tick() {
  clearTimeout(timer);
  if (running) {
    again = true;
    return;
  }
  running = true;
  try {
    do {
      again = false;
      await refresh();
    } while (again);
  } finally {
    running = false;
    timer = setTimeout(tick, POLL_MS);
  }
}

function openFromHash() {
  const m = /^#job\/(.+)$/.exec(location.hash);
  let id = null;
  if (m) {
    try {
      id = decodeURIComponent(m[1]);
    } catch (_) {
      id = null;
    }
  }
  view.job = id;
  drawn.delete('job');
  $('#job').hidden = id === null;
  if (id !== null) {
    $('#job-title').textContent = id;
    fill($('#job .body'), empty('loading…'));
    $('#job').scrollIntoView();
  }
  tick();
}

function init() {
  $('#token-form').addEventListener('submit', useToken);
  $('#forget-token').addEventListener('click', () => {
    sessionStorage.removeItem(TOKEN_KEY);
    drawn.clear();
    tick();
  });
  $('#job-close').addEventListener('click', () => {
    history.replaceState(null, '', location.pathname + location.search);
    openFromHash();
  });
  const onFilter = () => {
    view.queue = $('#filter-queue').value;
    view.state = $('#filter-state').value;
    view.limit = Number($('#filter-limit').value) || 20;
    view.cursors = [null];
    tick();
  };
  for (const id of ['#filter-queue', '#filter-state', '#filter-limit']) $(id).addEventListener('change', onFilter);
  $('#jobs-filter').addEventListener('submit', (e) => e.preventDefault());
  $('#first-page').addEventListener('click', () => { view.cursors = [null]; tick(); });
  $('#prev-page').addEventListener('click', () => {
    if (view.cursors.length > 1) view.cursors.pop();
    tick();
  });
  $('#next-page').addEventListener('click', () => {
    if (view.next) view.cursors.push(view.next);
    tick();
  });
  window.addEventListener('hashchange', openFromHash);
  if (/^#job\//.test(location.hash)) openFromHash();
  else tick();
}

init();

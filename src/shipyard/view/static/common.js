/* common.js — shared helpers of the `shipyard view` page (loaded first; plain globals, no build step).
 *
 * Contract: h() builds DOM from tags, attributes and text (data never passes through innerHTML);
 * api() fetches JSON and turns every failure (network, 4xx/5xx {"error"}, non-JSON) into an
 * ApiError whose message is plain text for the page; showError()/clearError() drive the global
 * [data-testid=error] banner; parseRoute() splits "#/<name>/<part>/...?<query>" (parts decoded);
 * POLL_MS is 2000 ms or the page's ?poll=<ms>; fmt*() format numbers, versions, ids and times.
 * Limits: one banner for the whole page (the last error wins); no retry logic here (callers poll).
 */
'use strict';

const POLL_MS = (() => {
  const v = Number(new URLSearchParams(location.search).get('poll'));
  return Number.isFinite(v) && v > 0 ? v : 2000;
})();

const PALETTE = ['#1f77b4', '#d62728', '#2ca02c', '#ff7f0e', '#9467bd',
  '#8c564b', '#e377c2', '#17becf', '#7f7f7f', '#bcbd22'];

/* ---- DOM ---------------------------------------------------------------------------------- */

/** Element `tag` with `attrs` (class, testid, on<event>, boolean true -> empty attribute) and children. */
function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === 'class') el.className = v;
    else if (k === 'testid') el.dataset.testid = v;
    else if (k.startsWith('on') && typeof v === 'function') el.addEventListener(k.slice(2), v);
    else el.setAttribute(k, v === true ? '' : String(v));
  }
  return append(el, children);
}

/** Append children (nodes, or anything else as text); null/undefined/false are skipped. */
function append(el, children) {
  for (const c of [children].flat(Infinity)) {
    if (c === null || c === undefined || c === false) continue;
    el.append(c instanceof Node ? c : String(c));
  }
  return el;
}

function main() { return document.getElementById('main'); }

function message(text, cls = 'message') { return h('p', { class: cls }, text); }

/* ---- the API ------------------------------------------------------------------------------ */

class ApiError extends Error {}

/** JSON from `path`; throws ApiError with the server's own message on any failure. */
async function api(path, options) {
  let resp;
  try {
    resp = await fetch(path, options);
  } catch (e) {
    throw new ApiError(`cannot reach the viewer server for ${path} (is shipyard view still running?)`);
  }
  let body = null;
  try { body = await resp.json(); } catch (e) { body = null; }
  if (!resp.ok) {
    const msg = body && typeof body.error === 'string' ? body.error : `${resp.status} ${resp.statusText} from ${path}`;
    throw new ApiError(msg);
  }
  if (body === null) throw new ApiError(`the viewer answered ${path} with something that is not JSON`);
  return body;
}

function enc(s) { return encodeURIComponent(String(s)); }
function runPath(label) { return `/api/runs/${enc(label)}`; }

/** The runs the server shows (also keeps the nav bar's Rollouts link on the first run). */
let knownRuns = [];
async function fetchRuns() {
  knownRuns = await api('/api/runs');
  updateNav();
  return knownRuns;
}
function setKnownRuns(statuses) { knownRuns = statuses; updateNav(); }
function updateNav() {
  const a = document.querySelector('[data-nav=rollouts]');
  if (a && knownRuns.length) a.setAttribute('href', `#/rollouts/${enc(knownRuns[0].label)}`);
}

/* ---- the error banner --------------------------------------------------------------------- */

let errorSource = null;

function showError(msg, source = 'page') {
  const el = document.querySelector('[data-testid=error]');
  el.textContent = msg;
  el.hidden = false;
  errorSource = source;
}

/** Hide the banner; with `source`, only if that source set it (a poll clears only its own error). */
function clearError(source) {
  if (source && errorSource !== source) return;
  const el = document.querySelector('[data-testid=error]');
  el.hidden = true;
  el.textContent = '';
  errorSource = null;
}

/** Show an ApiError's message, or a one-line description of a bug in the page (never a stack). */
function reportError(e, source) {
  if (e instanceof ApiError) showError(e.message, source);
  else showError(`the page failed: ${(e && e.message) || e}`, source);
}

/* ---- routes ------------------------------------------------------------------------------- */

let routeGen = 0;
/** True while the navigation that started as `gen` is still the current one. */
function isCurrent(gen) { return gen === routeGen; }

function safeDecode(s) {
  try { return decodeURIComponent(s); } catch (e) { return s; }
}

/** "#/rollout/run/a%2Fb?x=1" -> {name: "rollout", parts: ["run", "a/b"], query: URLSearchParams}. */
function parseRoute(hash) {
  const raw = hash.replace(/^#\/?/, '');
  const q = raw.indexOf('?');
  const path = q < 0 ? raw : raw.slice(0, q);
  const parts = path.split('/').filter((s) => s !== '').map(safeDecode);
  return { name: parts[0] || '', parts: parts.slice(1), query: new URLSearchParams(q < 0 ? '' : raw.slice(q + 1)) };
}

function rolloutHref(label, id) { return `#/rollout/${enc(label)}/${enc(id)}`; }

/* ---- formatting --------------------------------------------------------------------------- */

function isNum(v) { return typeof v === 'number' && Number.isFinite(v); }

function fmtNum(v, digits = 3) {
  if (!isNum(v)) return '–';
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  return v.toFixed(digits);
}

function fmtSigned(v, digits = 3) { return isNum(v) ? (v >= 0 ? '+' : '') + v.toFixed(digits) : 'n/a'; }

/** Policy versions that sampled a rollout: "v3", "v1–v2", or "none" (expert/demo, version -1). */
function fmtVersions(lo, hi) {
  if (!isNum(hi) || hi < 0) return 'none';
  return lo === hi ? `v${hi}` : `v${lo}–v${hi}`;
}

function fmtTime(unix) {
  return isNum(unix) ? new Date(unix * 1000).toLocaleString() : '–';
}

/** "w0/00000002/0/gen-00026/1" -> "w0/2/0/gen-00026/1" (zero-padded numbers shortened). */
function shortId(id) {
  return String(id).split('/').map((p) => (/^0+\d+$/.test(p) ? String(Number(p)) : p)).join('/');
}

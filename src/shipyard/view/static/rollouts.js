/* rollouts.js — the rollout list (#/rollouts/<label>?<filters>): filters, one page of 50 rows, pager.
 *
 * Contract: the filters live in the hash query under the API's own names (step, version, family,
 * task_id, min_reward, max_reward, flagged, trained, min_staleness, sort) plus offset; applying them
 * rewrites the hash and the page asks GET /api/runs/<label>/rollouts for 50 rows. Hooks:
 * [data-testid=filter-<name>], rollout-table with tr[data-rollout-id], prev-page / next-page /
 * page-info ("1–50 of 10000"), indexing ("indexing k/n batches", re-asked every POLL_MS until done),
 * empty (no rows, and why). Clicking a row opens #/rollout/<label>/<id>.
 * Limits: never more than 50 rows at once; once the index is complete the page does not follow a
 * live run (reload or re-apply to see new rollouts).
 */
'use strict';

const PAGE = 50;
const ANY_BOOL = [['', 'any'], ['true', 'yes'], ['false', 'no']];
const SORTS = ['-created', 'created', '-step', 'step', '-version', 'version', '-reward', 'reward',
  '-length', 'length', '-staleness', 'staleness', '-turns', 'turns'];

const FILTERS = [
  { name: 'step', label: 'step', type: 'number', size: 5 },
  { name: 'version', label: 'version', type: 'number', size: 5 },
  { name: 'family', label: 'family', options: [['', 'any']] },
  { name: 'task_id', label: 'task', type: 'text', size: 10 },
  { name: 'min_reward', label: 'reward ≥', type: 'number', size: 5, step: 'any' },
  { name: 'max_reward', label: 'reward ≤', type: 'number', size: 5, step: 'any' },
  { name: 'flagged', label: 'flagged', options: ANY_BOOL },
  { name: 'trained', label: 'trained', options: ANY_BOOL },
  { name: 'min_staleness', label: 'staleness ≥', type: 'number', size: 4 },
  { name: 'sort', label: 'sort', options: SORTS.map((s) => [s, sortLabel(s)]) },
];

function sortLabel(s) { return s.startsWith('-') ? `${s.slice(1)} ↓` : `${s} ↑`; }

const list = { label: null, root: null, controls: {}, results: null, pager: null, indexing: null };

/* ---- the filter form ---------------------------------------------------------------------- */

function filterControl(f) {
  const attrs = { testid: `filter-${f.name}`, name: f.name };
  if (f.options) {
    return h('select', { ...attrs, onchange: applyFilters }, f.options.map(([v, t]) => h('option', { value: v }, t)));
  }
  return h('input', { ...attrs, type: f.type, size: f.size, step: f.step, onchange: applyFilters });
}

function buildList(label) {
  list.label = label;
  list.controls = {};
  const fields = FILTERS.map((f) => {
    list.controls[f.name] = filterControl(f);
    return h('label', { class: 'filter' }, h('span', {}, f.label), list.controls[f.name]);
  });
  const form = h('form', { class: 'filters', onsubmit: (e) => { e.preventDefault(); applyFilters(); } },
    fields,
    h('button', { type: 'submit', testid: 'apply-filters' }, 'Apply'),
    h('button', { type: 'button', testid: 'reset-filters', onclick: () => { location.hash = `#/rollouts/${enc(label)}`; } }, 'Reset'));
  list.indexing = h('span', { class: 'indexing', testid: 'indexing', hidden: true });
  list.pager = h('div', { class: 'pager' },
    h('button', { type: 'button', testid: 'prev-page', onclick: () => turnPage(-1) }, '‹ Prev'),
    h('span', { testid: 'page-info', class: 'page-info' }, ''),
    h('button', { type: 'button', testid: 'next-page', onclick: () => turnPage(1) }, 'Next ›'),
    list.indexing);
  list.results = h('div', { class: 'results' }, message('loading…', 'muted'));
  list.root = h('div', { class: 'rollout-list' },
    h('section', { class: 'card' },
      h('header', { class: 'card-head' }, h('h2', {}, `Rollouts of ${label}`), runSelect(label)),
      form, list.pager),
    h('section', { class: 'card table-card' }, list.results));
  main().replaceChildren(list.root);
}

function runSelect(label) {
  const labels = knownRuns.map((r) => r.label);
  if (!labels.includes(label)) labels.unshift(label);
  return h('select', { testid: 'run-select', title: 'run', onchange: (e) => { location.hash = `#/rollouts/${enc(e.target.value)}`; } },
    labels.map((l) => h('option', { value: l, selected: l === label }, l)));
}

/** Set the controls from the hash query (an unknown family still shows as chosen). */
function syncControls(query) {
  for (const f of FILTERS) {
    const el = list.controls[f.name];
    const v = query.get(f.name) || (f.name === 'sort' ? '-created' : '');
    if (el.tagName === 'SELECT' && v && ![...el.options].some((o) => o.value === v)) el.append(h('option', { value: v }, v));
    el.value = v;
  }
}

function filterQuery() {
  const q = new URLSearchParams();
  for (const f of FILTERS) {
    const v = list.controls[f.name].value.trim();
    if (v && !(f.name === 'sort' && v === '-created')) q.set(f.name, v);
  }
  return q;
}

function listHash(q) {
  const s = q.toString();
  return `#/rollouts/${enc(list.label)}${s ? '?' + s : ''}`;
}

function applyFilters() {
  const target = listHash(filterQuery());
  if (location.hash === target) route();
  else location.hash = target;
}

function turnPage(dir) {
  const cur = parseRoute(location.hash).query;
  const q = filterQuery();
  const offset = Math.max(0, (parseInt(cur.get('offset'), 10) || 0) + dir * PAGE);
  if (offset) q.set('offset', String(offset));
  location.hash = listHash(q);
}

/* ---- one page ----------------------------------------------------------------------------- */

function flagCell(flags) {
  return h('td', { class: 'flags' }, (flags || []).map((f) => h('span', { class: 'flag hack', title: 'reward-hack flag' }, f)));
}

function rewardClass(r) { return r >= 1 ? 'good' : r > 0 ? 'part' : 'bad'; }

function rolloutRow(label, r) {
  const open = () => { location.hash = rolloutHref(label, r.id); };
  return h('tr', { 'data-rollout-id': r.id, class: r.flags && r.flags.length ? 'flagged' : null, onclick: open },
    h('td', { class: 'mono', title: r.id }, h('a', { href: rolloutHref(label, r.id) }, shortId(r.id))),
    h('td', {}, r.task_id), h('td', {}, r.family),
    h('td', { class: 'num' }, r.step === null ? '–' : r.step),
    h('td', {}, fmtVersions(r.version_min, r.version_max)),
    h('td', { class: `num reward ${rewardClass(r.reward)}` }, isNum(r.reward) ? r.reward.toFixed(3) : '–'),
    flagCell(r.flags),
    h('td', { class: 'num', title: `${r.sampled} sampled` }, r.length),
    h('td', { class: 'num' }, r.turns), h('td', { class: 'num' }, r.segments),
    h('td', { class: 'num' }, r.staleness === null ? '–' : r.staleness),
    h('td', {}, r.error ? h('span', { class: 'err' }, `error · ${r.finish}`) : r.finish));
}

const COLUMNS = ['id', 'task', 'family', 'step', 'versions', 'reward', 'flags', 'length', 'turns', 'segs', 'stale', 'finish'];

function rolloutTable(label, rows) {
  return h('table', { class: 'grid-table rollouts', testid: 'rollout-table' },
    h('thead', {}, h('tr', {}, COLUMNS.map((c) => h('th', {}, c)))),
    h('tbody', {}, rows.map((r) => rolloutRow(label, r))));
}

function emptyText(page, filtered) {
  if (page.problem) return `No rollouts to show: ${page.problem}`;
  if (page.indexed < page.batches) return `No rollouts indexed yet (indexing ${page.indexed}/${page.batches} batches)…`;
  if (filtered) return 'No rollouts match these filters.';
  return `Run ${list.label} has no rollouts yet: its workers have not written a rollout batch.`;
}

function setFamilies(families) {
  const sel = list.controls.family;
  const have = new Set([...sel.options].map((o) => o.value));
  for (const f of families || []) if (!have.has(f)) sel.append(h('option', { value: f }, f));
}

function renderPage(page, query, offset) {
  setFamilies(page.families);
  syncControls(query);
  const filtered = [...query.keys()].some((k) => k !== 'offset' && k !== 'sort');
  list.results.replaceChildren(page.rows.length
    ? rolloutTable(list.label, page.rows)
    : h('p', { class: 'empty-note', testid: 'empty' }, emptyText(page, filtered)));
  const end = offset + page.rows.length;
  list.pager.querySelector('[data-testid=page-info]').textContent =
    page.rows.length ? `${offset + 1}–${end} of ${page.total}` : `0 of ${page.total}`;
  list.pager.querySelector('[data-testid=prev-page]').disabled = offset <= 0;
  list.pager.querySelector('[data-testid=next-page]').disabled = end >= page.total;
  const busy = page.indexed < page.batches;
  list.indexing.hidden = !busy;
  list.indexing.textContent = busy ? `indexing ${page.indexed}/${page.batches} batches…` : `indexed ${page.indexed}/${page.batches} batches`;
}

async function loadPage(query, gen) {
  const params = new URLSearchParams();
  for (const f of FILTERS) if (query.get(f.name)) params.set(f.name, query.get(f.name));
  const offset = Math.max(0, parseInt(query.get('offset'), 10) || 0);
  params.set('offset', String(offset));
  params.set('limit', String(PAGE));
  let page;
  try {
    page = await api(`${runPath(list.label)}/rollouts?${params}`);
  } catch (e) {
    if (!isCurrent(gen)) return;
    reportError(e);
    list.results.replaceChildren(h('p', { class: 'empty-note', testid: 'empty' }, `Could not list rollouts: ${e.message}`));
    return;
  }
  if (!isCurrent(gen)) return;
  renderPage(page, query, offset);
  if (page.indexed < page.batches) setTimeout(() => { if (isCurrent(gen)) loadPage(query, gen); }, POLL_MS);
}

/* ---- the route ---------------------------------------------------------------------------- */

async function showRolloutList(r, gen) {
  const label = r.parts[0];
  if (!label) {
    const runs = await fetchRuns();
    if (!isCurrent(gen)) return;
    if (!runs.length) { main().replaceChildren(message('This viewer shows no runs: add one on the dashboard.')); return; }
    const q = r.query.toString();
    location.replace(`#/rollouts/${enc(runs[0].label)}${q ? '?' + q : ''}`);
    return;
  }
  if (!knownRuns.length) await fetchRuns().catch(() => null);
  if (!isCurrent(gen)) return;
  if (list.label !== label || !list.root || !list.root.isConnected) buildList(label);
  syncControls(r.query);
  await loadPage(r.query, gen);
}

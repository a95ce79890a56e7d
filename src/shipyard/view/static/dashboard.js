/* dashboard.js — the run dashboard (#/): per run its status line and problems, held-out evals, and
 * live uPlot charts with every run overlaid.
 *
 * Contract: each chart lives in [data-testid=chart-<name>] (data-points = its number of x values)
 * and its uPlot instance is window.shipyardCharts[name]; for per-step charts data[0] is the union
 * of the runs' steps and the series go run by run (data[1] = the first run's first metric).
 * Every POLL_MS it asks /api/runs, then per run metrics?after=<next> (appended), rewards, servers,
 * evals and health (the components' last progress, [data-testid=health], a row per component with
 * data-state ok|stalled and its stalls and crashes in td[data-testid=events]); charts change in place with setData and are rebuilt only when their series change
 * (a run is added, a hack flag first fires). The add-run form POSTs /api/runs {"dir"}.
 * Limits: metrics stay in memory for the page's life (fine for thousands of steps); rollouts are
 * never fetched here, so the first paint waits on nothing but /api/runs and the metrics.
 */
'use strict';

const dash = {
  labels: [],      // run labels in the server's order
  runs: {},        // label -> {label, status, records, next, rewards, servers, evals, seen}
  charts: {},      // chart name -> {box, note, plot, sig}
  version: 0,      // bumped when chart data changes; drawn = the version on screen
  drawn: -1,
  distRun: '',     // the run whose reward distribution is shown ('' = the first)
  root: null,
  timer: null,
  pending: false,
  observer: null,
};
window.shipyardCharts = {};

/* ---- chart definitions -------------------------------------------------------------------- */

const ratio = (a, b) => (isNum(a) && isNum(b) && b > 0 ? a / b : null);

const CHARTS = [
  { name: 'reward', unit: true, title: 'Reward (mean)', hint: 'reward/mean per trainer step, one line per run',
    build: () => stepSeries([{ key: 'reward/mean' }]) },
  { name: 'reward_dist', unit: true, title: 'Reward distribution', hint: 'trained rollouts per step: p10–p90 and p25–p75 bands, median, mean',
    build: () => distSeries(), controls: () => distSelect() },
  { name: 'solved', unit: true, title: 'Solved fraction', hint: 'reward/solved_frac per step',
    build: () => stepSeries([{ key: 'reward/solved_frac' }]) },
  { name: 'staleness', title: 'Staleness (versions)', hint: 'staleness/mean and staleness/max per step',
    build: () => stepSeries([{ key: 'staleness/mean', label: 'mean' }, { key: 'staleness/max', label: 'max' }]) },
  { name: 'mismatch', title: 'Sampler/trainer mismatch', hint: 'mismatch/k3 and mean |Δp| per step (log scale; zeros omitted)', log: true,
    build: () => stepSeries([{ key: 'mismatch/k3', label: 'k3' }, { key: 'mismatch/mean_abs_dp', label: 'mean |Δp|' }], true) },
  { name: 'sync', title: 'Weight sync (s)', hint: 'seconds from publication to adoption, by version, per inference server',
    build: () => syncSeries() },
  { name: 'version', title: 'Adopted version', hint: 'policy version each inference server serves, over wall-clock time',
    build: () => versionSeries() },
  { name: 'throughput', title: 'Throughput', hint: 'samples/s (left) and sampled tokens/s (right) per step',
    build: () => stepSeries([
      { label: 'samples/s', get: (r) => ratio(r['rollout/samples'], r['time/step_s']) },
      { label: 'tokens/s', get: (r) => ratio(r['rollout/sampled_tokens'], r['time/step_s']), scale: 'y2' }]) },
  { name: 'idle', unit: true, title: 'Trainer idle share', hint: 'time/wait_s ÷ time/step_s: the share of a step spent waiting for rollouts',
    build: () => stepSeries([{ label: 'idle', get: (r) => ratio(r['time/wait_s'], r['time/step_s']) }]) },
  { name: 'hacks', unit: true, title: 'Reward-hack flags', hint: 'hack/flagged_frac, and every hack/flag/* that is ever above 0',
    build: () => stepSeries(hackMetrics()) },
  { name: 'loss', title: 'Loss and grad norm', hint: 'train/loss (left axis) and train/grad_norm (right axis)',
    build: () => stepSeries([{ key: 'train/loss', label: 'loss' }, { key: 'train/grad_norm', label: 'grad norm', scale: 'y2' }]) },
];

function hackMetrics() {
  const flags = new Set();
  for (const label of dash.labels) {
    for (const r of dash.runs[label].records) {
      for (const [k, v] of Object.entries(r)) if (k.startsWith('hack/flag/') && isNum(v) && v > 0) flags.add(k);
    }
  }
  return [{ key: 'hack/flagged_frac', label: 'flagged' },
    ...[...flags].sort().map((k) => ({ key: k, label: k.slice('hack/flag/'.length) }))];
}

/* ---- series builders: each returns {series, data, xTime, empty, bands?} --------------------- */

function unionSorted(lists) {
  const all = new Set();
  for (const l of lists) for (const v of l) if (isNum(v)) all.add(v);
  return [...all].sort((a, b) => a - b);
}

/** One run: a colour per metric. Several runs: each run keeps its swatch colour, metrics differ by dash. */
function seriesStyle(runIdx, metricIdx, nRuns) {
  if (nRuns < 2) return { stroke: PALETTE[metricIdx % PALETTE.length] };
  const dashes = [null, [6, 3], [2, 3], [8, 3, 2, 3], [1, 2]];
  const d = dashes[metricIdx % dashes.length];
  return d ? { stroke: PALETTE[runIdx % PALETTE.length], dash: d } : { stroke: PALETTE[runIdx % PALETTE.length] };
}

/** One series per (run, metric), aligned on the union of the runs' steps. */
function stepSeries(metrics, log = false) {
  const runs = dash.labels.map((l) => dash.runs[l]);
  const steps = unionSorted(runs.map((r) => r.records.map((x) => x.step)));
  const series = [];
  const data = [steps];
  runs.forEach((run, ri) => {
    const at = new Map(run.records.map((r) => [r.step, r]));
    metrics.forEach((m, mi) => {
      const label = metrics.length > 1 ? `${run.label} ${m.label}` : run.label;
      series.push({ label, scale: m.scale || 'y', ...seriesStyle(ri, mi, runs.length) });
      data.push(steps.map((s) => {
        const rec = at.get(s);
        const v = rec ? (m.get ? m.get(rec) : rec[m.key]) : null;
        return isNum(v) && !(log && v <= 0) ? v : null;
      }));
    });
  });
  return { series, data, xTime: false, empty: steps.length ? null : 'no steps yet' };
}

function distRun() {
  return dash.runs[dash.distRun] ? dash.distRun : dash.labels[0];
}

/** The chosen run's reward quantiles: series mean, median, p10, p90, p25, p75 (+ two bands). */
function distSeries() {
  const label = distRun();
  const r = (label && dash.runs[label].rewards) || { steps: [] };
  const steps = r.steps || [];
  const keys = [['mean', 'mean', '#d62728'], ['p50', 'median', '#1f77b4'],
    ['p10', 'p10', '#9ecae1'], ['p90', 'p90', '#9ecae1'], ['p25', 'p25', '#6baed6'], ['p75', 'p75', '#6baed6']];
  const series = keys.map(([, name, stroke], i) => ({ label: `${label || ''} ${name}`.trim(), stroke, scale: 'y', dash: i === 0 ? [6, 3] : null }));
  const data = [steps, ...keys.map(([k]) => (r[k] || []).map((v) => (isNum(v) ? v : null)))];
  const bands = [{ series: [4, 3], fill: 'rgba(31,119,180,0.12)' }, { series: [6, 5], fill: 'rgba(31,119,180,0.22)' }];
  return { series, data, bands, xTime: false, empty: steps.length ? null : 'no trained rollouts yet' };
}

/** Every server of every run, labelled (``run/server`` when several runs are shown). */
function allServers() {
  const out = [];
  for (const label of dash.labels) {
    for (const s of dash.runs[label].servers || []) {
      out.push({ label: dash.labels.length > 1 ? `${label}/${s.name}` : s.name, adoptions: s.adoptions || [] });
    }
  }
  return out;
}

/** One series per server: ``y`` of its adoptions against ``x``, aligned on the union of x values. */
function serverSeries(x, y, { xTime, stepped }) {
  const servers = allServers();
  const xs = unionSorted(servers.map((s) => s.adoptions.map((a) => a[x])));
  const data = [xs];
  const series = servers.map((s, i) => {
    const at = new Map(s.adoptions.map((a) => [a[x], a[y]]));
    data.push(xs.map((v) => (isNum(at.get(v)) ? at.get(v) : null)));
    return { label: s.label, stroke: PALETTE[i % PALETTE.length], scale: 'y', ...(stepped ? { stepped } : {}) };
  });
  return { series, data, xTime, empty: xs.length ? null : 'no weight adoptions yet' };
}

const syncSeries = () => serverSeries('version', 'sync_s', { xTime: false, stepped: false });
const versionSeries = () => serverSeries('at', 'version', { xTime: true, stepped: true });

/* ---- uPlot -------------------------------------------------------------------------------- */

const STEP_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];
const logTicks = (u, splits) => splits.map((v) => (v == null ? '' : v.toExponential(0)));

/** Log for mismatch; fractions and rewards span at least [0, 1] (a flat 0 line stays readable). */
function yScale(def) {
  if (def.log) return { distr: 3, log: 10 };
  if (def.unit) return { range: (u, lo, hi) => [Math.min(0, isNum(lo) ? lo : 0), Math.max(1, isNum(hi) ? hi : 1)] };
  return {};
}

function plotOpts(def, built, width) {
  const usesY2 = built.series.some((s) => s.scale === 'y2');
  const stepped = uPlot.paths.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined;
  const axes = [built.xTime ? {} : { incrs: STEP_INCRS }, def.log ? { scale: 'y', size: 56, values: logTicks } : { scale: 'y', size: 56 }];
  if (usesY2) axes.push({ scale: 'y2', side: 1, size: 56, grid: { show: false } });
  return {
    width,
    height: 200,
    scales: { x: { time: built.xTime }, y: yScale(def), y2: {} },
    axes,
    series: [
      { label: built.xTime ? 'time' : def.name === 'sync' ? 'version' : 'step' },
      ...built.series.map((s) => ({
        label: s.label, stroke: s.stroke, width: 1.5, scale: s.scale, spanGaps: true,
        dash: s.dash || undefined, paths: s.stepped ? stepped : undefined,
        value: (u, v) => fmtNum(v, 4),
      })),
    ],
    bands: built.bands,
    cursor: built.xTime ? {} : { sync: { key: 'shipyard-steps' } },
    legend: { live: true },
  };
}

function chartWidth(box) { return Math.max(200, box.clientWidth || 400); }

/** Draw chart `def`: rebuild when its series changed, else setData in place. */
function renderChart(def) {
  const c = dash.charts[def.name];
  if (!c) return;
  const built = def.build();
  const sig = JSON.stringify([built.series.map((s) => [s.label, s.scale]), built.xTime]);
  if (!c.plot || c.sig !== sig) {
    if (c.plot) c.plot.destroy();
    c.plot = new uPlot(plotOpts(def, built, chartWidth(c.box)), built.data, c.box);
    c.sig = sig;
    window.shipyardCharts[def.name] = c.plot;
  } else {
    c.plot.setData(built.data);
  }
  c.box.dataset.points = String(built.data[0].length);
  c.note.textContent = built.empty || '';
  c.note.hidden = !built.empty;
}

function chartCard(def) {
  const note = h('div', { class: 'chart-note', hidden: true });
  const box = h('div', { class: 'chart', testid: `chart-${def.name}`, 'data-points': '0' }, note);
  dash.charts[def.name] = { box, note, plot: null, sig: null };
  if (dash.observer) dash.observer.observe(box);
  return h('section', { class: 'card chart-card' },
    h('header', { class: 'card-head' }, h('h3', {}, def.title), def.controls ? def.controls() : null),
    box,
    h('p', { class: 'hint' }, def.hint));
}

function distSelect() {
  return h('select', { class: 'dist-run', testid: 'dist-run', title: 'run shown', onchange: (e) => {
    dash.distRun = e.target.value;
    dash.version++;
    scheduleRender();
  } });
}

function renderDistSelect() {
  const sel = dash.root && dash.root.querySelector('.dist-run');
  if (!sel) return;
  const want = dash.labels.join('\n');
  if (sel.dataset.labels !== want) {
    sel.replaceChildren(...dash.labels.map((l) => h('option', { value: l }, l)));
    sel.dataset.labels = want;
  }
  sel.value = distRun() || '';
  sel.hidden = dash.labels.length < 2;
}

function onResize(entries) {
  for (const e of entries) {
    const c = Object.values(dash.charts).find((x) => x.box === e.target);
    if (c && c.plot && Math.abs(c.plot.width - chartWidth(c.box)) > 1) c.plot.setSize({ width: chartWidth(c.box), height: 200 });
  }
}

/* ---- runs, problems, evals ---------------------------------------------------------------- */

function modelText(m) {
  if (!m || (!m.source && !m.path)) return 'model ?';
  return `model ${m.path || m.source}${m.source === 'tiny' && m.tiny ? ` (${m.tiny})` : ''}`;
}

function precisionText(p) {
  if (!p) return 'precision ?';
  const t = p.trainer ? (p.trainer.bf16_decoder ? 'bf16' : 'fp32') : '?';
  const i = p.inference ? p.inference.dtype : '?';
  return `trainer ${t} · inference ${i}`;
}

function precisionReason(p) {
  if (!p) return 'the run has no summary.json yet';
  return [p.trainer && p.trainer.reason, p.inference && p.inference.reason].filter(Boolean).join('\n');
}

function statusLine(run, i) {
  const s = run.status;
  const planned = isNum(s.steps_planned) ? s.steps_planned : '?';
  const indexing = s.rollout_batches > s.rollouts_indexed ? ` (indexing ${s.rollouts_indexed}/${s.rollout_batches})` : '';
  return h('div', { class: 'run' },
    h('div', { class: 'run-status', testid: 'run-status', 'data-run': s.label, title: `${s.dir}\nrun id ${s.run_id || '?'}` },
      h('span', { class: 'swatch', style: `background:${PALETTE[i % PALETTE.length]}` }),
      h('b', {}, s.label),
      h('span', { class: `state state-${s.state}` }, s.state),
      h('span', {}, `step ${s.steps_done}/${planned}`),
      isNum(s.steps_planned) && s.steps_planned > 0 ? h('progress', { max: s.steps_planned, value: s.steps_done }) : null,
      h('span', {}, modelText(s.model)),
      h('span', { title: precisionReason(s.precision) }, precisionText(s.precision)),
      h('span', { class: 'muted' }, `started ${fmtTime(s.created_at)}`),
      h('a', { href: `#/rollouts/${enc(s.label)}` }, `rollouts${indexing}`)),
    h('ul', { class: 'problems', testid: 'problems', 'data-run': s.label, hidden: !s.problems.length },
      s.problems.map((p) => h('li', {}, p))));
}

function renderRuns() {
  const box = dash.root && dash.root.querySelector('.runs-list');
  if (!box) return;
  const lines = dash.labels.filter((l) => dash.runs[l].status).map((l, i) => statusLine(dash.runs[l], i));
  box.replaceChildren(...(lines.length ? lines : [message('loading runs…', 'muted')]));
}

function renderEvals() {
  const body = dash.root && dash.root.querySelector('[data-testid=evals] tbody');
  if (!body) return;
  const rows = [];
  for (const label of dash.labels) {
    for (const e of dash.runs[label].evals || []) {
      rows.push(h('tr', { 'data-eval': e.name, 'data-run': label },
        h('td', {}, label), h('td', {}, e.name), h('td', { class: 'num' }, e.n),
        h('td', { class: 'num' }, fmtNum(e.value)), h('td', { class: 'num' }, `[${fmtNum(e.low)}, ${fmtNum(e.high)}]`)));
    }
  }
  if (!rows.length) rows.push(h('tr', { class: 'empty' }, h('td', { colspan: 5 }, 'no held-out evaluations yet')));
  body.replaceChildren(...rows);
}

function renderHealth() {
  const body = dash.root && dash.root.querySelector('[data-testid=health] tbody');
  if (!body) return;
  const rows = [];
  for (const label of dash.labels) {
    for (const c of dash.runs[label].health || []) {
      rows.push(h('tr', { 'data-component': c.component, 'data-run': label, 'data-state': c.state, class: c.state === 'stalled' ? 'stalled' : '' },
        h('td', {}, label), h('td', {}, c.component), h('td', {}, c.phase), h('td', { class: 'num' }, c.ticks),
        h('td', { class: 'num' }, `${fmtNum(c.age_s)} s`), h('td', { class: 'num' }, `${fmtNum(c.deadline_s)} s`),
        h('td', {}, c.state), h('td', { testid: 'events' }, healthEvents(c))));
    }
  }
  if (!rows.length) rows.push(h('tr', { class: 'empty' }, h('td', { colspan: 8 }, 'no component reported progress yet (health.jsonl)')));
  body.replaceChildren(...rows);
}

// "2 stalls, 1 crash; last: crash at 12:03:04 (actor died ...): starting a new actor", or "-"
function healthEvents(c) {
  const e = c.last_event;
  if (!e) return '-';
  const plural = (n, w) => `${n} ${w}${n === 1 ? '' : (w === 'crash' ? 'es' : 's')}`;
  const what = e.what ? ` (${e.what})` : '';
  return `${plural(c.stalls || 0, 'stall')}, ${plural(c.crashes || 0, 'crash')}; last: ${e.kind} at ${fmtTime(e.at)}${what}${e.action ? `: ${e.action}` : ''}`;
}

function addRunForm() {
  const input = h('input', { type: 'text', testid: 'add-run-input', placeholder: 'another run directory, e.g. runs/demo', size: 40 });
  const button = h('button', { type: 'submit', testid: 'add-run' }, 'Add run');
  return h('form', { class: 'add-run', onsubmit: (e) => { e.preventDefault(); addRun(input, button); } },
    input, button);
}

async function addRun(input, button) {
  const dir = input.value.trim();
  if (!dir) { showError('type a run directory to add (a run directory is <run.output_dir>/<run.name>)', 'add-run'); return; }
  button.disabled = true;
  try {
    const status = await api('/api/runs', { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ dir }) });
    clearError('add-run');
    input.value = '';
    takeStatuses([...dash.labels.filter((l) => l !== status.label).map((l) => dash.runs[l].status).filter(Boolean), status]);
    scheduleRender();
    await pollRun(dash.runs[status.label], routeGen);
  } catch (e) {
    reportError(e, 'add-run');
  } finally {
    button.disabled = false;
  }
}

/* ---- state and polling -------------------------------------------------------------------- */

function runState(label) {
  if (!dash.runs[label]) {
    dash.runs[label] = { label, status: null, records: [], next: 0, rewards: null, servers: [], evals: [], health: [], seen: {} };
  }
  return dash.runs[label];
}

function takeStatuses(statuses) {
  const labels = statuses.map((s) => s.label);
  if (labels.join('\n') !== dash.labels.join('\n')) dash.version++;
  dash.labels = labels;
  for (const s of statuses) runState(s.label).status = s;
  setKnownRuns(statuses);
}

function takeMetrics(run, after, m) {
  if (after !== run.next) return;            // an older poll's answer
  if (m.next < after) { run.records = []; run.next = 0; dash.version++; return; }  // the file shrank
  if (m.records.length) { run.records.push(...m.records); dash.version++; }
  run.next = m.next;
}

/** Keep run[key] = value, bumping the chart version when it changed. */
function takePart(run, key, value) {
  const s = JSON.stringify(value);
  if (run.seen[key] === s) return;
  run.seen[key] = s;
  run[key] = value;
  dash.version++;
}

async function pollRun(run, gen) {
  const base = runPath(run.label);
  const after = run.next;
  const jobs = [
    api(`${base}/metrics?after=${after}`).then((m) => takeMetrics(run, after, m)),
    api(`${base}/rewards`).then((r) => takePart(run, 'rewards', r)),
    api(`${base}/servers`).then((s) => takePart(run, 'servers', s)),
    api(`${base}/evals`).then((e) => takePart(run, 'evals', e)),
    api(`${base}/health`).then((x) => takePart(run, 'health', x)),
  ].map((p) => p.then(() => { if (isCurrent(gen)) scheduleRender(); }));
  const bad = (await Promise.allSettled(jobs)).find((r) => r.status === 'rejected');
  if (bad) throw bad.reason;
}

async function pollDashboard(gen) {
  if (!isCurrent(gen)) return;
  try {
    takeStatuses(await api('/api/runs'));
    if (!isCurrent(gen)) return;
    scheduleRender();
    await Promise.all(dash.labels.map((l) => pollRun(runState(l), gen)));
    if (isCurrent(gen)) clearError('poll');
  } catch (e) {
    if (isCurrent(gen)) reportError(e, 'poll');
  }
  if (isCurrent(gen)) dash.timer = setTimeout(() => pollDashboard(gen), POLL_MS);
}

function scheduleRender() {
  if (dash.pending) return;
  dash.pending = true;
  setTimeout(() => { dash.pending = false; renderDashboard(); }, 0);
}

function renderDashboard() {
  if (!dash.root) return;
  renderRuns();
  renderEvals();
  renderHealth();
  if (dash.version === dash.drawn) return;
  dash.drawn = dash.version;
  renderDistSelect();
  for (const def of CHARTS) renderChart(def);
}

/* ---- entering and leaving the route ------------------------------------------------------- */

function showDashboard(gen) {
  dash.observer = typeof ResizeObserver === 'function' ? new ResizeObserver(onResize) : null;
  dash.charts = {};
  window.shipyardCharts = {};
  const runsCard = h('section', { class: 'card runs-card' },
    h('header', { class: 'card-head' }, h('h2', {}, 'Runs'), h('span', { class: 'muted live' }, `live · every ${POLL_MS / 1000} s`)),
    h('div', { class: 'runs-list' }), addRunForm());
  const evalsCard = h('section', { class: 'card evals-card' },
    h('h3', {}, 'Held-out evaluations (95% intervals)'),
    h('table', { class: 'grid-table', testid: 'evals' },
      h('thead', {}, h('tr', {}, ['run', 'evaluation', 'n', 'value', '[low, high]'].map((t) => h('th', {}, t)))),
      h('tbody', {})));
  const healthCard = h('section', { class: 'card health-card' },
    h('h3', {}, 'Health: each component\'s last progress (a stall is named by the watchdog)'),
    h('table', { class: 'grid-table', testid: 'health' },
      h('thead', {}, h('tr', {}, ['run', 'component', 'phase', 'ticks', 'last progress', 'deadline', 'state', 'stalls and crashes'].map((t) => h('th', {}, t)))),
      h('tbody', {})));
  const grid = h('div', { class: 'charts' }, CHARTS.map(chartCard));
  dash.root = h('div', { class: 'dashboard' }, runsCard, evalsCard, healthCard, grid);
  main().replaceChildren(dash.root);
  dash.drawn = -1;
  renderDashboard();                 // what earlier visits fetched, at once
  pollDashboard(gen);
}

function leaveDashboard() {
  clearTimeout(dash.timer);
  if (dash.observer) dash.observer.disconnect();
  for (const c of Object.values(dash.charts)) if (c.plot) c.plot.destroy();
  dash.charts = {};
  dash.root = null;
  window.shipyardCharts = {};
}

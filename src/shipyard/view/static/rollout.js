/* rollout.js — one rollout (#/rollout/<label>/<id>) and two side by side (#/compare/<label>/<a>/<b>).
 *
 * Contract: asks GET /api/runs/<label>/rollout?id=<id> once per session shown and renders its
 * header [data-testid=rollout-header], segments [data-testid=segment] (a "context reset" boundary
 * between them) with turns [data-testid=turn][data-role]: prompt (system prompt collapsed),
 * assistant (+ [data-testid=tool-call] badge), tool (pre[data-testid=tool-output]), summary, record;
 * the diff (pre[data-testid=diff], hljs language-diff) and the grader report [data-testid=grade].
 * [data-testid=token-mode] switches assistant/summary text to span.tok per sampled token coloured
 * by sampler logprob or by trainer − sampler logprob (title: both logprobs, Δ and version).
 * [data-testid=compare-select] lists up to 100 other rollouts of the same task.
 * Limits: every token is a span in the token modes (fine for tens of thousands of tokens);
 * code fences are highlighted, the text itself is shown exactly as the API gives it.
 */
'use strict';

let tokenMode = 'text';
const sessionViews = [];   // {turnBodies: [{el, turn}], note, trainer} of the sessions on screen

/* ---- tokens ------------------------------------------------------------------------------- */

function lpColor(lp) {
  if (!isNum(lp)) return '#ddd';
  const t = Math.min(1, Math.max(0, -lp / 6));
  return `hsl(${Math.round(50 - 50 * t)}, 90%, ${Math.round(100 - 42 * t)}%)`;
}

function deltaColor(slp, tlp) {
  if (!isNum(tlp) || !isNum(slp)) return '#d4d4d4';
  const d = tlp - slp;
  const t = Math.sqrt(Math.min(1, Math.abs(d) / 0.5));
  return `hsl(${d >= 0 ? 210 : 0}, 85%, ${Math.round(100 - 40 * t)}%)`;
}

function tokenTitle(slp, tlp, ver) {
  const d = isNum(tlp) && isNum(slp) ? tlp - slp : null;
  const f = (v) => (isNum(v) ? v.toFixed(3) : 'n/a');
  return `sampler lp ${f(slp)} · trainer lp ${f(tlp)} · Δ ${fmtSigned(d)} · v${ver}`;
}

function tokensNode(tokens, mode) {
  const box = h('div', { class: 'text tokens' });
  const frag = document.createDocumentFragment();
  for (const [text, slp, tlp, ver] of tokens) {
    const span = document.createElement('span');
    span.className = 'tok';
    span.textContent = text;
    span.title = tokenTitle(slp, tlp, ver);
    span.style.background = mode === 'logprob' ? lpColor(slp) : deltaColor(slp, tlp);
    frag.append(span);
  }
  box.append(frag);
  return box;
}

function tokenLegend(mode) {
  const stops = mode === 'logprob'
    ? [[0, 'lp 0'], [-0.5, '-0.5'], [-2, '-2'], [-4, '-4'], [-6, '≤ -6']].map(([v, t]) => [lpColor(v), t])
    : [[-0.5, 'Δ ≤ -0.5'], [-0.05, '-0.05'], [0, '0'], [0.05, '+0.05'], [0.5, '≥ +0.5']]
      .map(([v, t]) => [deltaColor(0, v), t]).concat([[deltaColor(0, null), 'no trainer lp']]);
  if (mode === 'text') return h('span', { class: 'legend', testid: 'token-legend', hidden: true });
  return h('span', { class: 'legend', testid: 'token-legend' },
    mode === 'logprob' ? 'sampler logprob: ' : 'trainer − sampler logprob: ',
    stops.map(([bg, t]) => h('span', { class: 'swatch-tok', style: `background:${bg}` }, t)));
}

/* ---- text with highlighted code fences (textContent stays exactly `text`) ----------------- */

function codeText(text) {
  const box = h('div', { class: 'text' });
  const re = /```([\w+-]*)\n([\s\S]*?)```/g;
  let last = 0;
  let m;
  while ((m = re.exec(text))) {
    box.append(text.slice(last, m.index));
    const code = h('code', { class: 'fence-code' }, m[2]);
    const lang = m[1].toLowerCase();
    if (lang && hljs.getLanguage(lang)) {
      code.classList.add(`language-${lang}`);
      hljs.highlightElement(code);
    }
    box.append(h('span', { class: 'fence' }, '```' + m[1] + '\n', code, '```'));
    last = re.lastIndex;
  }
  box.append(text.slice(last));
  return box;
}

function turnBody(turn, mode) {
  if (mode !== 'text' && Array.isArray(turn.tokens)) return tokensNode(turn.tokens, mode);
  if (turn.role === 'assistant' || turn.role === 'summary') return codeText(turn.text || '');
  return h('pre', { class: 'text' }, turn.text || '');
}

/* ---- turns -------------------------------------------------------------------------------- */

function toolBadge(turn) {
  const what = { run: `run: ${turn.command || ''}`, write: `write: ${turn.path || ''}`, submit: 'submit' }[turn.action];
  if (what) return h('span', { class: `badge tool-call action-${turn.action}`, testid: 'tool-call' }, what);
  return h('span', { class: 'badge muted', title: 'the reply held no runnable action' }, 'no action');
}

function turnHead(name, turn, ...extra) {
  const n = isNum(turn.end) && isNum(turn.start) ? turn.end - turn.start : null;
  return h('div', { class: 'turn-head' }, h('span', { class: 'role' }, name), extra,
    h('span', { class: 'muted span-range' }, n === null ? '' : `tokens ${turn.start}–${turn.end} (${n})`));
}

function promptTurn(turn, segIndex) {
  return h('div', { class: 'turn prompt', testid: 'turn', 'data-role': 'prompt' },
    turnHead('prompt', turn),
    turn.system ? h('details', { class: 'system' }, h('summary', {}, 'system prompt'), h('pre', { class: 'text' }, turn.system)) : null,
    h('details', { class: 'prompt-body', open: segIndex === 0 },
      h('summary', {}, segIndex === 0 ? 'task prompt' : 'prompt (the task and the summary so far)'),
      h('pre', { class: 'text' }, turn.text || '')));
}

function plainTurn(turn, bodies, segCount) {
  const role = turn.role;
  const body = h('div', { class: 'turn-body' });
  let head;
  if (role === 'assistant') head = turnHead('assistant', turn, toolBadge(turn));
  else if (role === 'summary') head = turnHead('summary', turn, h('span', { class: 'badge summary-badge' }, 'ends this segment'));
  else if (role === 'tool') head = turnHead('tool output', turn);
  else if (role === 'record') head = turnHead('record', turn, h('span', { class: 'muted' }, 'whole session as one text (older run format: no turns)'));
  else head = turnHead(role, turn);
  if (role === 'tool') body.append(h('pre', { class: 'text tool-output', testid: 'tool-output' }, turn.text || ''));
  else {
    body.append(turnBody(turn, tokenMode));
    bodies.push({ el: body, turn });
  }
  return h('div', { class: `turn ${role}`, testid: 'turn', 'data-role': role }, head, body);
}

function segmentView(seg, i, n, bodies) {
  const turns = (seg.turns || []).map((t) => (t.role === 'prompt' ? promptTurn(t, i) : plainTurn(t, bodies, n)));
  const facts = [`finish ${seg.finish}`, `${seg.length} tokens`, `prompt ${seg.prompt_len}`];
  if (seg.summary_tokens) facts.push(`summary ${seg.summary_tokens}`);
  return h('section', { class: 'segment', testid: 'segment', 'data-index': seg.index },
    h('div', { class: 'segment-head' }, h('b', {}, `Segment ${i + 1} of ${n}`), h('span', { class: 'muted' }, facts.join(' · '))),
    turns);
}

function boundary(prev) {
  const why = prev.finish === 'summary' ? 'context reset after summary' : `context reset (previous segment finished: ${prev.finish})`;
  return h('div', { class: 'boundary', testid: 'segment-boundary' }, h('span', {}, `${why} — the next segment starts from a fresh prompt`));
}

function segmentsCard(d) {
  const bodies = [];
  const segs = d.segments || [];
  const children = [];
  segs.forEach((seg, i) => {
    if (i > 0) children.push(boundary(segs[i - 1]));
    children.push(segmentView(seg, i, segs.length, bodies));
  });
  const note = h('p', { class: 'token-note' },
    'trainer logprobs were not recorded for this rollout (not trained, or the run kept none): every token is grey.');
  sessionViews.push({ bodies, note, trainer: !!d.trainer_logprobs });
  return h('section', { class: 'card segments-card' },
    h('h3', {}, `Session: ${segs.length} segment(s), ${d.turns} turn(s)`), note,
    children.length ? children : message('this rollout has no segments'));
}

function applyTokenMode() {
  for (const v of sessionViews) {
    for (const b of v.bodies) b.el.replaceChildren(turnBody(b.turn, tokenMode));
    v.note.hidden = !(tokenMode === 'mismatch' && !v.trainer);
  }
  const old = document.querySelector('[data-testid=token-legend]');
  if (old) old.replaceWith(tokenLegend(tokenMode));
}

function tokenToolbar() {
  const sel = h('select', { testid: 'token-mode', onchange: (e) => { tokenMode = e.target.value; applyTokenMode(); } },
    [['text', 'text'], ['logprob', 'sampler logprob'], ['mismatch', 'trainer − sampler']]
      .map(([v, t]) => h('option', { value: v, selected: v === tokenMode }, t)));
  return h('label', { class: 'token-toolbar' }, h('span', {}, 'tokens '), sel, tokenLegend(tokenMode));
}

/* ---- header, diff, grade ------------------------------------------------------------------ */

function kv(k, v, cls) { return h('div', { class: `kv ${cls || ''}` }, h('span', { class: 'k' }, k), h('span', { class: 'v' }, v)); }

function headerCard(label, d) {
  const info = d.reward_info || {};
  const tests = isNum(info.total) ? `${info.passed}/${info.total} tests passed` : '–';
  const comps = Object.entries(d.reward_components || {}).map(([k, v]) => `${k} ${fmtNum(v)}`).join(', ');
  const taskLink = h('a', { href: `#/rollouts/${enc(label)}?task_id=${enc(d.task_id)}`, title: 'all rollouts of this task' }, d.task_id);
  return h('section', { class: 'card', testid: 'rollout-header' },
    h('h2', { class: 'mono rollout-id' }, d.id),
    h('div', { class: 'kvs' },
      kv('task', taskLink), kv('family', d.family),
      kv('reward', fmtNum(d.reward), `reward ${rewardClass(d.reward)}`), kv('tests', tests),
      comps ? kv('components', comps) : null,
      kv('step', d.step === null ? 'not trained' : d.step), kv('versions', fmtVersions(d.version_min, d.version_max)),
      kv('staleness', d.staleness === null ? '–' : d.staleness), kv('finish', d.finish),
      kv('flags', (d.flags || []).length ? d.flags.map((f) => h('span', { class: 'flag hack' }, f)) : 'none'),
      kv('tokens', `${d.length} (${d.sampled} sampled)`), kv('turns', `${d.turns} in ${(d.segments || []).length} segment(s)`),
      kv('worker', d.worker), kv('created', fmtTime(d.created_at))),
    info.reason ? h('p', { class: 'reason' }, `grader: ${info.reason}`) : null,
    d.error_text ? h('pre', { class: 'error-text', testid: 'error-text' }, d.error_text) : null);
}

function diffCard(d) {
  const text = d.changes || '';
  const pre = h('pre', { class: text ? 'diff language-diff' : 'diff empty', testid: 'diff' }, text || 'no files changed');
  if (text) hljs.highlightElement(pre);
  return h('section', { class: 'card diff-card' }, h('h3', {}, 'Changed files'), pre);
}

function testsTable(tests) {
  const rows = Object.entries(tests || {});
  if (!rows.length) return message('no per-test outcomes', 'muted');
  return h('table', { class: 'grid-table tests' },
    h('thead', {}, h('tr', {}, h('th', {}, 'test'), h('th', {}, 'outcome'), h('th', {}, 'time (s)'))),
    h('tbody', {}, rows.map(([name, t]) => h('tr', { 'data-test': name },
      h('td', { class: 'mono' }, name), h('td', { class: `outcome ${t && t.outcome}` }, (t && t.outcome) || '?'),
      h('td', { class: 'num' }, fmtNum(t && t.time_s))))));
}

function gradeCard(d) {
  const g = d.grade || {};
  if (!Object.keys(g).length) {
    return h('section', { class: 'card', testid: 'grade' }, h('h3', {}, 'Grader report'), message('no grader report for this rollout', 'muted'));
  }
  const reason = g.reason || (d.reward_info || {}).reason;
  return h('section', { class: 'card grade-card', testid: 'grade' },
    h('h3', {}, 'Grader report'),
    h('div', { class: 'kvs' },
      kv('reason', reason || '–'), kv('return code', g.returncode ?? '–'),
      kv('duration', isNum(g.duration_s) ? `${g.duration_s} s` : '–'),
      (g.dropped_files || []).length ? kv('dropped files', g.dropped_files.join(', ')) : null),
    testsTable(g.tests),
    g.log_tail ? h('details', { open: true }, h('summary', {}, 'log tail'), h('pre', { class: 'log-tail' }, g.log_tail)) : null);
}

/* ---- compare ------------------------------------------------------------------------------ */

async function fillCompare(select, label, d, gen) {
  const q = new URLSearchParams({ task_id: d.task_id, limit: '100', sort: 'version' });
  try {
    const page = await api(`${runPath(label)}/rollouts?${q}`);
    if (!isCurrent(gen)) return;
    const others = page.rows.filter((r) => r.id !== d.id);
    select.replaceChildren(h('option', { value: '' }, others.length
      ? `compare with another rollout of ${d.task_id} (${others.length})…` : `no other rollouts of ${d.task_id}`),
    ...others.map((r) => h('option', { value: r.id },
      `${fmtVersions(r.version_min, r.version_max)} · reward ${fmtNum(r.reward)} · ${shortId(r.id)}`)));
    select.disabled = !others.length;
  } catch (e) {
    if (isCurrent(gen)) select.replaceChildren(h('option', { value: '' }, `cannot list other rollouts: ${e.message}`));
  }
}

function compareSelect(label, d, gen) {
  const sel = h('select', { testid: 'compare-select', disabled: true, onchange: (e) => {
    if (e.target.value) location.hash = `#/compare/${enc(label)}/${enc(d.id)}/${enc(e.target.value)}`;
  } }, h('option', { value: '' }, 'loading other rollouts of this task…'));
  fillCompare(sel, label, d, gen);
  return sel;
}

/* ---- routes ------------------------------------------------------------------------------- */

function fetchRollout(label, id) {
  return api(`${runPath(label)}/rollout?id=${enc(id)}`);
}

function backLinks(label) {
  return h('nav', { class: 'crumbs' }, h('a', { href: '#/' }, 'Dashboard'), ' / ',
    h('a', { href: `#/rollouts/${enc(label)}` }, `Rollouts of ${label}`));
}

async function showRollout(r, gen) {
  const [label, id] = r.parts;
  sessionViews.length = 0;
  if (!label || !id) throw new ApiError('this address names no rollout: use #/rollout/<run>/<rollout id>');
  main().replaceChildren(message('loading rollout…', 'muted'));
  let d;
  try {
    d = await fetchRollout(label, id);
  } catch (e) {
    if (isCurrent(gen)) main().replaceChildren(backLinks(label), h('p', { class: 'empty-note' }, `Cannot show this rollout: ${e.message}`));
    throw e;
  }
  if (!isCurrent(gen)) return;
  const toolbar = h('div', { class: 'toolbar card' }, backLinks(label), tokenToolbar(), compareSelect(label, d, gen));
  main().replaceChildren(h('div', { class: 'rollout-view' }, toolbar, headerCard(label, d),
    h('div', { class: 'two-col' }, diffCard(d), gradeCard(d)), segmentsCard(d)));
  applyTokenMode();
}

function sessionColumn(label, d, testid) {
  return h('div', { class: 'compare-col', testid }, headerCard(label, d), diffCard(d), gradeCard(d), segmentsCard(d));
}

async function showCompare(r, gen) {
  const [label, a, b] = r.parts;
  sessionViews.length = 0;
  if (!label || !a || !b) throw new ApiError('this address names no pair of rollouts: use #/compare/<run>/<id a>/<id b>');
  main().replaceChildren(message('loading both rollouts…', 'muted'));
  const got = await Promise.allSettled([fetchRollout(label, a), fetchRollout(label, b)]);
  if (!isCurrent(gen)) return;
  const col = (res, testid) => (res.status === 'fulfilled' ? sessionColumn(label, res.value, testid)
    : h('div', { class: 'compare-col', testid }, h('p', { class: 'empty-note' }, `Cannot show this rollout: ${res.reason.message}`)));
  const toolbar = h('div', { class: 'toolbar card' }, backLinks(label), tokenToolbar());
  main().replaceChildren(h('div', { class: 'compare-view' }, toolbar,
    h('div', { class: 'compare' }, col(got[0], 'compare-left'), col(got[1], 'compare-right'))));
  applyTokenMode();
  const bad = got.find((x) => x.status === 'rejected');
  if (bad) throw bad.reason;
}

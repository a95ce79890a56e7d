/* app.js — the router of the `shipyard view` page (loaded last).
 *
 * Contract: hash routes #/ (dashboard), #/rollouts/<label>?<filters>, #/rollout/<label>/<id>,
 * #/compare/<label>/<id a>/<id b> (parts URI-encoded). Each navigation clears the error banner,
 * leaves the previous view (its polling stops) and starts the new one under a fresh generation
 * number, so late answers of an earlier view are dropped. Any failure becomes a plain message
 * in [data-testid=error]; an unknown route says so.
 * Limits: no history state beyond the hash; views re-render from scratch (the rollout list keeps
 * its form while only the query changes).
 */
'use strict';

const ROUTES = {
  '': (r, gen) => showDashboard(gen),
  rollouts: showRolloutList,
  rollout: showRollout,
  compare: showCompare,
};

function setActiveNav(name) {
  for (const a of document.querySelectorAll('[data-nav]')) {
    const on = a.dataset.nav === (name === '' ? 'dashboard' : 'rollouts');
    a.classList.toggle('active', on);
  }
}

function route() {
  const gen = ++routeGen;
  const r = parseRoute(location.hash);
  leaveDashboard();
  clearError();
  setActiveNav(r.name);
  const view = ROUTES[r.name];
  if (!view) {
    main().replaceChildren(message(`There is no page at ${location.hash}.`, 'empty-note'));
    showError(`no page ${location.hash}: use #/ (dashboard), #/rollouts/<run>, #/rollout/<run>/<id> or #/compare/<run>/<a>/<b>`);
    return;
  }
  Promise.resolve()
    .then(() => view(r, gen))
    .catch((e) => { if (isCurrent(gen)) reportError(e); });
}

window.addEventListener('hashchange', route);
window.addEventListener('error', (e) => showError(`the page failed: ${e.message}`));
window.addEventListener('unhandledrejection', (e) => reportError(e.reason));
if (typeof hljs !== 'undefined') hljs.configure({ ignoreUnescapedHTML: true });
route();

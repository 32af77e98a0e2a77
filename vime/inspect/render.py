"""Static HTML for the inspector: one page per rollout and an index. Everything the model or a user wrote goes
through `html.escape`; the pages carry their own CSS and JavaScript (no network, no server) and open from disk.

The page's structure is what tests and scripts read: each sample is a `section.sample` with data-index,
data-group, data-status, data-source, data-reward and data-spans (its weight_version_spans as JSON); each response
token a `span.tok` (class `trained` or
`untrained` after its loss_mask entry, `marked` for the tokens `vime.inspect.load.marked_tokens` picked) with
data-lp (the engine's log-prob) and, where saved, data-train-lp (the trainer's) and, where the trainer's advantages
differ between the sample's tokens, data-adv. The header's `b.f-advantages` is the trainer's advantage ("advantages
(trainer)"), `b.f-advantage` the inspector's group-normalised one ("advantage (computed)") where the trainer saved
none.
"""

from __future__ import annotations

import json
from html import escape

from vime.inspect.load import RolloutView, SampleView

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em; color: #1b1b1b; }
h1 { font-size: 1.3em; } h2 { font-size: 1.05em; margin: 0 0 .4em; }
table { border-collapse: collapse; margin: .4em 0; } td, th { border: 1px solid #ccc; padding: 2px 6px; }
.filters { position: sticky; top: 0; background: #f4f4f4; padding: .5em; border: 1px solid #ddd; z-index: 1; }
.sample { border: 1px solid #bbb; border-radius: 4px; padding: .6em; margin: .8em 0; }
.sample.failed { border-color: #c00; }
.text { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 13px; }
.prompt { color: #555; background: #fafafa; border-left: 3px solid #ccc; padding: .3em; }
.tok.trained { background: #d7f5d7; } .tok.untrained { background: #e4e4e4; color: #666; }
.tok.marked { outline: 2px solid #d40; } .failure { color: #c00; } .note { color: #666; font-size: 12px; }
.legend span { padding: 0 .4em; margin-right: .5em; }
"""

JS = """
(function () {
  const $ = (id) => document.getElementById(id);
  const samples = Array.from(document.querySelectorAll('section.sample'));
  function apply() {
    const lo = parseFloat($('f-min').value), hi = parseFloat($('f-max').value);
    const status = $('f-status').value, source = $('f-source').value;
    let shown = 0;
    for (const s of samples) {
      const r = s.dataset.reward === '' ? NaN : parseFloat(s.dataset.reward);
      let ok = true;
      if (!isNaN(lo) && !(r >= lo)) ok = false;
      if (!isNaN(hi) && !(r <= hi)) ok = false;
      if (status === 'failed' && s.dataset.status !== 'failed') ok = false;
      if (status === 'ok' && s.dataset.status === 'failed') ok = false;
      if (source !== '' && s.dataset.source !== source) ok = false;
      s.hidden = !ok;
      shown += ok;
    }
    $('f-count').textContent = shown + ' of ' + samples.length + ' samples shown';
    const state = new URLSearchParams();
    if (!isNaN(lo)) state.set('min', lo);
    if (!isNaN(hi)) state.set('max', hi);
    if (status) state.set('status', status);
    if (source) state.set('source', source);
    history.replaceState(null, '', '#' + state.toString());
  }
  const initial = new URLSearchParams(location.hash.slice(1));
  $('f-min').value = initial.get('min') || '';
  $('f-max').value = initial.get('max') || '';
  $('f-status').value = initial.get('status') || '';
  $('f-source').value = initial.get('source') || '';
  for (const id of ['f-min', 'f-max', 'f-status', 'f-source']) $(id).addEventListener('input', apply);
  document.addEventListener('mouseover', (e) => {
    const t = e.target;
    if (!t.classList || !t.classList.contains('tok') || t.title) return;
    const i = parseInt(t.dataset.i), section = t.closest('section.sample');
    let title = 'token ' + i + ' \u00b7 engine log-prob ' + parseFloat(t.dataset.lp).toFixed(5);
    if (t.dataset.trainLp !== undefined) title += ' \u00b7 trainer ' + parseFloat(t.dataset.trainLp).toFixed(5);
    if (t.dataset.adv !== undefined) title += ' \u00b7 advantage ' + parseFloat(t.dataset.adv).toFixed(4);
    for (const [v, start, end] of JSON.parse(section.dataset.spans || '[]'))
      if (start <= i && i < end) title += ' \u00b7 weight version ' + v;
    t.title = title;
  });
  apply();
})();
"""


def _page(title: str, body: str, script: str = "") -> str:
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{escape(title)}</title>"
            f"<style>{CSS}</style></head>\n<body>\n{body}\n"
            + (f"<script>{script}</script>\n" if script else "") + "</body></html>\n")


def _num(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _kv_table(items: dict) -> str:
    rows = "".join(f"<tr><th>{escape(str(k))}</th><td>{escape(json.dumps(v, ensure_ascii=False))}</td></tr>"
                   for k, v in items.items())
    return f"<table>{rows}</table>"


def _tokens(view: SampleView) -> str:
    """One span per response token. The markup is kept small (a page may hold millions of tokens): the hover text
    (log-probs, weight version) is made by the page's script from data-lp, data-train-lp and the section's
    data-spans."""
    raw = view.raw
    n = raw.get("response_length") or 0
    engine = raw.get("rollout_log_probs") or [0.0] * n
    mask = _mask(raw)
    marked = set(view.marked)
    per_token_advantages = view.train_advantages if _varies(view.train_advantages) else None
    out = []
    for i, piece in enumerate(view.pieces):
        cls = "tok " + ("trained" if mask[i] else "untrained") + (" marked" if i in marked else "")
        train = "" if view.train_log_probs is None else f' data-train-lp="{view.train_log_probs[i]!r}"'
        adv = "" if per_token_advantages is None else f' data-adv="{per_token_advantages[i]!r}"'
        out.append(f'<span class="{cls}" data-i="{i}" data-lp="{engine[i]!r}"{train}{adv}>{escape(piece)}</span>')
    return "".join(out)


def _varies(values: list[float] | None) -> bool:
    return values is not None and len(set(values)) > 1


def trainer_advantage_text(advantages: list[float], mask: list[int]) -> str:
    """The header's "advantages (trainer)": the one value of the trained tokens (GRPO and the other per-sample
    estimators), else their mean and range (per-token estimators: PPO's GAE, REINFORCE++ with a KL penalty)."""
    trained = [a for a, m in zip(advantages, mask) if m] or advantages
    if not trained:
        return ""
    if len(set(trained)) == 1:
        return _num(trained[0])
    return f"{_num(sum(trained) / len(trained))} (per token {_num(min(trained))} to {_num(max(trained))})"


def _mask(raw: dict) -> list[int]:
    n = raw.get("response_length") or 0
    return raw.get("loss_mask") if raw.get("loss_mask") is not None else [1] * n


def _marked_table(view: SampleView) -> str:
    if not view.marked:
        return ""
    engine = view.raw.get("rollout_log_probs") or []
    trainer = view.train_log_probs
    what = ("largest |trainer - engine| log-prob gaps, largest first" if trainer
            else "least likely trained tokens (engine log-prob), least likely first")
    head = "<tr><th>token</th><th>text</th><th>engine log-prob</th>" + (
        "<th>trainer log-prob</th><th>gap</th>" if trainer else "") + "</tr>"
    rows = []
    for i in view.marked:
        cells = f"<td>{i}</td><td class=\"text\">{escape(view.pieces[i])}</td><td>{engine[i]:.5f}</td>"
        if trainer:
            cells += f"<td>{trainer[i]:.5f}</td><td>{trainer[i] - engine[i]:+.5f}</td>"
        rows.append(f"<tr class=\"marked-row\">{cells}</tr>")
    return f"<details><summary>marked: {what}</summary><table>{head}{''.join(rows)}</table></details>"


def _sample(view: SampleView) -> str:
    raw = view.raw
    status = raw.get("status", "")
    reward = raw.get("reward")
    failure = view.failure
    facts = {
        "sample": raw.get("index"), "group": raw.get("group_index"), "status": status,
        "reward": reward if not isinstance(reward, dict) else _num(view.reward),
        **({"advantages (trainer)": trainer_advantage_text(view.train_advantages, _mask(raw))}
           if view.train_advantages is not None else {"advantage (computed)": _num(view.advantage)}),
        "data source": view.source,
        "response tokens": raw.get("response_length"), "trained tokens": sum(raw.get("loss_mask") or []),
        "weight versions": ", ".join(map(str, raw.get("weight_versions") or [])),
    }
    head = " · ".join(f"{k}: <b class=\"f-{k.split()[0]}\">{escape(str(v))}</b>" for k, v in facts.items())
    parts = f"<details open><summary>reward parts</summary>{_kv_table(reward)}</details>" \
        if isinstance(reward, dict) else ""
    spans = raw.get("weight_version_spans") or []
    spans_html = ("<div class=\"note\">weight version spans (response tokens [start, end)): "
                  + escape(", ".join(f"{v}: [{a}, {b})" for v, a, b in spans)) + "</div>") if spans else ""
    fail_html = (f"<div class=\"failure\">failed at {escape(str(failure.get('stage')))}: "
                 f"<b>{escape(str(failure.get('reason')))}</b> — {escape(str(failure.get('error')))}</div>"
                 if failure else "")
    metadata = {k: v for k, v in (raw.get("metadata") or {}).items() if k != "failure"}
    reward_attr = "" if view.reward is None else repr(view.reward)
    return (f'<section class="sample{" failed" if status == "failed" else ""}" data-index="{raw.get("index")}" '
            f'data-group="{raw.get("group_index")}" data-status="{escape(status)}" '
            f'data-source="{escape(view.source)}" data-reward="{reward_attr}" '
            f'data-spans="{escape(json.dumps(spans))}">\n'
            f"<h2>{head}</h2>{fail_html}{parts}{spans_html}\n"
            f"<details><summary>prompt ({len(raw.get('tokens') or []) - (raw.get('response_length') or 0)} "
            f"tokens)</summary><div class=\"text prompt\">{escape(view.prompt_text)}</div></details>\n"
            f"<div class=\"text response\">{_tokens(view)}</div>\n{_marked_table(view)}"
            + (f"<details><summary>metadata</summary>{_kv_table(metadata)}</details>" if metadata else "")
            + "</section>")


def rollout_page(view: RolloutView) -> str:
    sources = sorted({s.source for s in view.samples})
    options = "".join(f'<option value="{escape(s)}">{escape(s)}</option>' for s in sources)
    filters = (
        '<div class="filters">reward from <input id="f-min" type="number" step="any" size="6"> to '
        '<input id="f-max" type="number" step="any" size="6"> · status <select id="f-status">'
        '<option value="">all</option><option value="failed">failed</option><option value="ok">not failed</option>'
        f'</select> · data source <select id="f-source"><option value="">all</option>{options}</select> · '
        '<span id="f-count"></span></div>')
    legend = ('<p class="legend"><span class="tok trained">trained token (loss_mask 1)</span>'
              '<span class="tok untrained">not trained (loss_mask 0)</span>'
              '<span class="tok marked">marked</span> hover a token for its log-probs (engine, trainer), advantage '
              'and weight version</p>')
    title = f"{view.name} ({len(view.samples)} samples)" if not view.pages else \
        f"{view.name}, page {view.page + 1} of {len(view.pages)} ({len(view.samples)} samples)"
    metrics = (f"<details><summary>rollout metrics (metrics.jsonl)</summary>{_kv_table(view.metrics)}</details>"
               if view.metrics else "")
    pages = "" if not view.pages else " · pages: " + " ".join(
        f'<b>{k + 1}</b>' if k == view.page else f'<a class="page" href="{escape(name)}.html">{k + 1}</a>'
        for k, name in enumerate(view.pages)) + " (the filters act on this page)"
    body = (f'<p><a href="index.html">all rollouts</a>{pages}</p><h1>{escape(title)}</h1>{filters}{legend}'
            f'<p class="note advantages-note">{escape(view.advantages_note)}</p>{metrics}\n'
            + "\n".join(_sample(s) for s in view.samples))
    return _page(title, body, JS)


def index_page(run: str, views: list[RolloutView]) -> str:
    rows = []
    for v in views:
        rewards = [s.reward for s in v.samples if s.reward is not None]
        failed = sum(s.raw.get("status") == "failed" for s in v.samples)
        mean = _num(sum(rewards) / len(rewards)) if rewards else ""
        rows.append(f'<tr class="rollout"><td><a href="{escape(v.name)}.html">{escape(v.name)}</a></td>'
                    f"<td>{len(v.samples)}</td><td>{failed}</td><td>{mean}</td><td>{len(v.pages) or 1}</td></tr>")
    body = (f"<h1>Rollouts of {escape(run)}</h1><table><tr><th>rollout</th><th>samples</th><th>failed</th>"
            f"<th>reward mean</th><th>pages</th></tr>{''.join(rows)}</table>"
            + ("" if views else "<p>No rollouts saved (a run keeps them in OUTPUT_DIR/rollouts unless "
                                "--no-save-rollouts).</p>"))
    return _page(f"vime inspect: {run}", body)

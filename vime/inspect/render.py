"""Static HTML for the inspector: one page per rollout and an index. The pages carry their own CSS and JavaScript
(no network, no server) and open from disk.

A saved rollout is untrusted input (a file anyone may have made or edited), so: every attribute value and every
text goes through `html.escape`, numbers included (`_attr`, `_text`, `_plain`); each page carries a
Content-Security-Policy that runs only its own script and style, allowed by their sha256 hashes, and loads nothing
(`content_security_policy`); the page has no inline event handlers; bidi control characters (U+202A..U+202E,
U+2066..U+2069, U+200E, U+200F, U+061C), which would reorder the text around them, are shown as marked `\\u202e`
and the model's text sits in isolating elements (`<bdi>`, `dir="auto"`, `unicode-bidi: isolate`).

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

import base64
import hashlib
import json
import re
from html import escape
from urllib.parse import quote

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
b, td, th, option { unicode-bidi: isolate; }
.ctl { color: #a0a; border: 1px dotted #a0a; font-family: ui-monospace, monospace; font-size: 11px; }
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
    const t = e.target.closest && e.target.closest('span.tok[data-i]');  // the token, also over a marker in it
    if (!t || t.title) return;
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


BIDI_CONTROLS = "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
_BIDI_CONTROL = re.compile(f"[{BIDI_CONTROLS}]")


def _spelled(match: re.Match) -> str:
    return f"\\u{ord(match[0]):04x}"


def _marked(match: re.Match) -> str:
    return f'<span class="ctl">{_spelled(match)}</span>'


def _plain(value) -> str:
    """`value` for an attribute, <title> or <option>: escaped, quotes included, each bidi control character spelled
    out as `\\u202e` (raw, it would reorder the text around it)."""
    text = str(value)
    if not text.isascii():  # the controls are not ASCII: most values (numbers, ids) skip the search
        text = _BIDI_CONTROL.sub(_spelled, text)
    return escape(text)


def _text(value) -> str:
    """`value` as page text: escaped, each bidi control character shown as a marked `\\u202e`."""
    text = escape(str(value))
    return text if text.isascii() else _BIDI_CONTROL.sub(_marked, text)


def _isolated(value) -> str:
    """Text set among the page's own words: in a <bdi>, so that right-to-left text cannot reorder them."""
    return f"<bdi>{_text(value)}</bdi>"


def _attr(name: str, value) -> str:
    return f' {name}="{_plain(value)}"'


def _link(page_name: str) -> str:
    """The href of the page written as <page_name>.html: percent-encoded, so that any file name links to itself."""
    return _attr("href", quote(f"{page_name}.html"))


def inline_hash(source: str) -> str:
    """The CSP source that allows the inline <script> or <style> whose text is exactly `source`."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(source.encode("utf-8")).digest()).decode("ascii") + "'"


def content_security_policy(style: str, script: str) -> str:
    """Nothing loads and nothing runs but the page's own style and script (a page without one runs none): text a
    rollout smuggled past the escaping still could not run or fetch anything."""
    scripts = inline_hash(script) if script else "'none'"
    return (f"default-src 'none'; style-src {inline_hash(style)}; script-src {scripts}; base-uri 'none'; "
            "form-action 'none'")


def _page(title: str, body: str, script: str = "") -> str:
    csp = _attr("content", content_security_policy(CSS, script))
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\"{csp}><title>{_plain(title)}</title>"
            f"<style>{CSS}</style></head>\n<body>\n{body}\n"
            + (f"<script>{script}</script>\n" if script else "") + "</body></html>\n")


def _num(x: float | None, digits: int = 4) -> str:
    return "" if x is None else f"{x:.{digits}f}"


def _kv_table(items: dict) -> str:
    rows = "".join(f"<tr><th>{_text(k)}</th><td>{_text(json.dumps(v, ensure_ascii=False))}</td></tr>"
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
        train = "" if view.train_log_probs is None else _attr("data-train-lp", repr(view.train_log_probs[i]))
        adv = "" if per_token_advantages is None else _attr("data-adv", repr(per_token_advantages[i]))
        out.append(f'<span{_attr("class", cls)}{_attr("data-i", i)}{_attr("data-lp", repr(engine[i]))}{train}{adv}>'
                   f"{_text(piece)}</span>")
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
        cells = f"<td>{i}</td><td class=\"text\">{_text(view.pieces[i])}</td><td>{engine[i]:.5f}</td>"
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
    head = " · ".join(f"{k}: <b class=\"f-{k.split()[0]}\">{_text(v)}</b>" for k, v in facts.items())
    parts = f"<details open><summary>reward parts</summary>{_kv_table(reward)}</details>" \
        if isinstance(reward, dict) else ""
    spans = raw.get("weight_version_spans") or []
    spans_html = ("<div class=\"note\">weight version spans (response tokens [start, end)): "
                  + _isolated(", ".join(f"{v}: [{a}, {b})" for v, a, b in spans)) + "</div>") if spans else ""
    fail_html = (f"<div class=\"failure\">failed at {_isolated(failure.get('stage'))}: "
                 f"<b>{_text(failure.get('reason'))}</b> — {_isolated(failure.get('error'))}</div>"
                 if failure else "")
    metadata = {k: v for k, v in (raw.get("metadata") or {}).items() if k != "failure"}
    reward_attr = "" if view.reward is None else repr(view.reward)
    attrs = (_attr("class", "sample failed" if status == "failed" else "sample") + _attr("data-index", raw.get("index"))
             + _attr("data-group", raw.get("group_index")) + _attr("data-status", status)
             + _attr("data-source", view.source) + _attr("data-reward", reward_attr)
             + _attr("data-spans", json.dumps(spans)))
    return (f"<section{attrs}>\n"
            f"<h2>{head}</h2>{fail_html}{parts}{spans_html}\n"
            f"<details><summary>prompt ({len(raw.get('tokens') or []) - (raw.get('response_length') or 0)} "
            f"tokens)</summary><div class=\"text prompt\" dir=\"auto\">{_text(view.prompt_text)}</div></details>\n"
            f"<div class=\"text response\" dir=\"auto\">{_tokens(view)}</div>\n{_marked_table(view)}"
            + (f"<details><summary>metadata</summary>{_kv_table(metadata)}</details>" if metadata else "")
            + "</section>")


def rollout_page(view: RolloutView) -> str:
    sources = sorted({s.source for s in view.samples})
    options = "".join(f'<option{_attr("value", s)}>{_plain(s)}</option>' for s in sources)
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
    where = f" ({len(view.samples)} samples)" if not view.pages else \
        f", page {view.page + 1} of {len(view.pages)} ({len(view.samples)} samples)"
    metrics = (f"<details><summary>rollout metrics (metrics.jsonl)</summary>{_kv_table(view.metrics)}</details>"
               if view.metrics else "")
    pages = "" if not view.pages else " · pages: " + " ".join(
        f'<b>{k + 1}</b>' if k == view.page else f'<a class="page"{_link(name)}>{k + 1}</a>'
        for k, name in enumerate(view.pages)) + " (the filters act on this page)"
    body = (f'<p><a href="index.html">all rollouts</a>{pages}</p><h1>{_isolated(view.name)}{where}</h1>{filters}'
            f'{legend}<p class="note advantages-note">{_text(view.advantages_note)}</p>{metrics}\n'
            + "\n".join(_sample(s) for s in view.samples))
    return _page(view.name + where, body, JS)


def index_page(run: str, views: list[RolloutView]) -> str:
    rows = []
    for v in views:
        rewards = [s.reward for s in v.samples if s.reward is not None]
        failed = sum(s.raw.get("status") == "failed" for s in v.samples)
        mean = _num(sum(rewards) / len(rewards)) if rewards else ""
        rows.append(f'<tr class="rollout"><td><a{_link(v.name)}>{_text(v.name)}</a></td>'
                    f"<td>{len(v.samples)}</td><td>{failed}</td><td>{mean}</td><td>{len(v.pages) or 1}</td></tr>")
    body = (f"<h1>Rollouts of {_isolated(run)}</h1><table><tr><th>rollout</th><th>samples</th><th>failed</th>"
            f"<th>reward mean</th><th>pages</th></tr>{''.join(rows)}</table>"
            + ("" if views else "<p>No rollouts saved (a run keeps them in OUTPUT_DIR/rollouts unless "
                                "--no-save-rollouts).</p>"))
    return _page(f"vime inspect: {run}", body)

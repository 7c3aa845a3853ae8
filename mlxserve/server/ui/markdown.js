// A small Markdown renderer for model answers that never trusts its input: every piece
// of text is HTML-escaped before any tag of ours is added, and links keep only http(s) and
// mailto URLs. Every block except a fenced code block ends at a blank line, so the
// rendering of a text is the concatenation of the renderings of its blank-line-separated
// parts: IncrementalMarkdown renders the finished parts of a streaming answer once and
// only re-renders the unfinished tail.

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const QUOTE = /^ {0,3}>\s?(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const SAFE_URL = /^(https?:\/\/|mailto:)/i;

/** Inline Markdown of one line or paragraph: code spans, bold, italic, strike, links. */
export function renderInline(text) {
  let out = "";
  let last = 0;
  // Code spans first: nothing inside them is Markdown.
  for (const m of text.matchAll(/(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)/g)) {
    out += inlineText(text.slice(last, m.index));
    out += `<code>${escapeHtml(m[2].trim() || m[2])}</code>`;
    last = m.index + m[0].length;
  }
  return out + inlineText(text.slice(last));
}

function inlineText(raw) {
  // Escaped first: the patterns below see no '<' or '"', so what they add is only ours.
  let s = escapeHtml(raw);
  s = s.replace(/\[([^\]\n]+)\]\(([^()\s]+)\)/g, (_, label, url) => {
    const href = url.replace(/&amp;/g, "&");
    if (!SAFE_URL.test(href)) return label;
    return `<a href="${escapeHtml(href)}" target="_blank" rel="noopener noreferrer">${label}</a>`;
  });
  // A bare URL stops before an escaped quote or bracket and before trailing punctuation.
  const bare = /(^|[\s(])(https?:\/\/(?:(?!&(?:quot|#39|lt|gt);)[^\s<])*[^\s<.,;:!?)\]'"&])/g;
  s = s.replace(bare, (_, lead, url) => {
    return `${lead}<a href="${url}" target="_blank" rel="noopener noreferrer">${url}</a>`;
  });
  s = s.replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^\w])__(?=\S)([\s\S]*?\S)__(?!\w)/g, "$1<strong>$2</strong>");
  s = s.replace(/(^|[^*\w])\*(?=[^\s*])([^*]*?[^\s*])\*(?!\*)/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^\w])_(?=[^\s_])([^_]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  return s.replace(/\n/g, "<br>");
}

/** A fenced code block with its language and a copy button (app.js handles the click). */
export function renderCode(code, lang) {
  const name = (lang || "").replace(/[^\w+#.-]/g, "");
  const cls = name ? ` class="language-${name}"` : "";
  return (
    `<div class="code-block"><div class="code-head"><span>${name || "text"}</span>` +
    `<button type="button" class="copy-code" aria-label="Copy code">Copy</button></div>` +
    `<pre><code${cls}>${escapeHtml(code)}</code></pre></div>`
  );
}

/** The HTML of a Markdown text (an unclosed code fence runs to the end, as while streaming). */
export function renderMarkdown(text) {
  const lines = text.replace(/\r\n?/g, "\n").split("\n");
  let html = "";
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i++;
      continue;
    }
    const fence = FENCE.exec(line);
    if (fence) {
      const marker = fence[1];
      const body = [];
      i++;
      while (i < lines.length && !isClosingFence(lines[i], marker)) body.push(lines[i++]);
      i++; // the closing fence, if any
      html += renderCode(body.join("\n"), fence[2]);
      continue;
    }
    const heading = HEADING.exec(line);
    if (heading) {
      const level = heading[1].length;
      html += `<h${level}>${renderInline(heading[2])}</h${level}>`;
      i++;
      continue;
    }
    if (RULE.test(line)) {
      html += "<hr>";
      i++;
      continue;
    }
    // The other blocks run to the next blank line (or a fence, heading or rule).
    const block = [];
    while (i < lines.length && lines[i].trim() && (block.length === 0 || !startsBlock(lines[i]))) {
      block.push(lines[i++]);
    }
    html += renderParagraphBlock(block);
  }
  return html;
}

function isClosingFence(line, marker) {
  const t = line.trim();
  return t.length >= marker.length && t === marker[0].repeat(t.length);
}

function startsBlock(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line);
}

function renderParagraphBlock(block) {
  if (block.every((l) => QUOTE.test(l))) {
    return `<blockquote>${renderMarkdown(block.map((l) => QUOTE.exec(l)[1]).join("\n"))}</blockquote>`;
  }
  if (LIST_ITEM.test(block[0])) return renderList(block);
  if (block.length >= 2 && block[0].includes("|") && TABLE_RULE.test(block[1])) {
    return renderTable(block);
  }
  return `<p>${renderInline(block.join("\n"))}</p>`;
}

function renderList(block) {
  const first = LIST_ITEM.exec(block[0]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const items = [];
  for (const line of block) {
    const m = LIST_ITEM.exec(line);
    if (m && m[1].length <= indent) items.push([m[3]]);
    else items[items.length - 1].push(line.slice(Math.min(indent + 2, line.search(/\S/))));
  }
  const lis = items.map(([head, ...rest]) => {
    const nested = rest.length && LIST_ITEM.test(rest[0]) ? renderList(rest) : "";
    const more = nested ? "" : rest.join("\n");
    return `<li>${renderInline(more ? `${head}\n${more}` : head)}${nested}</li>`;
  });
  const start = ordered ? Number.parseInt(first[2], 10) : 1;
  const tag = ordered ? "ol" : "ul";
  const attr = ordered && start !== 1 ? ` start="${start}"` : "";
  return `<${tag}${attr}>${lis.join("")}</${tag}>`;
}

function renderTable(block) {
  const cells = (line) =>
    line
      .trim()
      .replace(/^\||\|$/g, "")
      .split("|")
      .map((c) => renderInline(c.trim()));
  const head = cells(block[0]).map((c) => `<th>${c}</th>`).join("");
  const rows = block
    .slice(2)
    .map((l) => `<tr>${cells(l).map((c) => `<td>${c}</td>`).join("")}</tr>`)
    .join("");
  return `<div class="table-wrap"><table><thead><tr>${head}</tr></thead><tbody>${rows}</tbody></table></div>`;
}

/**
 * Renders a growing text into an element: finished blocks once, the rest on each update.
 * While a code fence is open at the end, its new text is appended to the code element
 * instead of re-rendering the whole block (a long code answer would cost O(n) per update).
 */
export class IncrementalMarkdown {
  constructor(element) {
    this.stable = document.createElement("div");
    this.tail = document.createElement("div");
    this.stable.className = "md-stable";
    this.tail.className = "md-tail";
    element.replaceChildren(this.stable, this.tail);
    this.done = 0; // text[0:done] is rendered in this.stable
    this.scanned = 0; // start of the first line not yet scanned for a cut
    this.fence = null; // the open fence while scanning inside a code block: {marker, lang, start, body}
    this.afterBlank = false;
    this.live = null; // the open fence's code text node in this.tail, and where it starts
  }

  update(text) {
    const cut = this.#lastCut(text);
    if (cut > this.done) {
      this.stable.insertAdjacentHTML("beforeend", renderMarkdown(text.slice(this.done, cut)));
      this.done = cut;
      this.live = null;
    }
    const fence = this.fence;
    // Not live when the unfinished last line is the closing fence: it ends the block.
    if (!fence || fence.start < this.done || isClosingFence(text.slice(this.scanned), fence.marker)) {
      this.live = null;
      this.tail.innerHTML = renderMarkdown(text.slice(this.done));
      return;
    }
    if (this.live?.start !== fence.start) {
      const before = renderMarkdown(text.slice(this.done, fence.start));
      this.tail.innerHTML = before + renderCode("", fence.lang);
      const node = document.createTextNode("");
      this.tail.querySelector(".code-block:last-child code").append(node);
      this.live = { start: fence.start, node };
    }
    const body = text.slice(fence.body);
    const node = this.live.node;
    if (body.startsWith(node.data)) node.appendData(body.slice(node.length));
    else node.data = body;
  }

  // The start of the last complete line that begins a block after a blank line, outside
  // a code fence: everything before it is finished Markdown.
  #lastCut(text) {
    let cut = this.done;
    let end;
    while ((end = text.indexOf("\n", this.scanned)) !== -1) {
      const line = text.slice(this.scanned, end);
      if (this.fence) {
        if (isClosingFence(line, this.fence.marker)) this.fence = null;
      } else if (!line.trim()) {
        this.afterBlank = true;
      } else {
        if (this.afterBlank && !/^\s/.test(line)) cut = this.scanned;
        this.afterBlank = false;
        const fence = FENCE.exec(line);
        if (fence) this.fence = { marker: fence[1], lang: fence[2], start: this.scanned, body: end + 1 };
      }
      this.scanned = end + 1;
    }
    return cut;
  }
}

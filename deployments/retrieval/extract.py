"""What an uploaded file is, and the text in it.

`media_type_of(filename, head)` decides a file's type at upload, from its extension and a
sniff of its first bytes; `extract_text(path, media_type, max_chars)` reads the text out
of it when a vector store indexes it. Both read the one table below (`TYPES`), so a file
the upload took is one the extractor knows how to read.

A text type's media type carries the charset the sniff found (`; charset=utf-8`, or
`windows-1252` for a legacy file that is not UTF-8), which is what extraction decodes
with. Every bound is checked while reading, not after: a file whose text would pass
`max_chars` (a PDF or HTML bomb) fails as soon as it does.
"""

import codecs
import re
from html.parser import HTMLParser
from pathlib import Path

SNIFF_BYTES = 64 * 1024  # the start of a file that the upload checks (and no more)
MAX_PDF_PAGES = 5000  # a page costs a parse of its content stream: bound the work, too
FEED_CHARS = 1 << 20  # HTML is fed in pieces so that a bomb fails before it is all parsed
UTF8, LEGACY = "utf-8", "windows-1252"  # what browsers read as "latin-1" is windows-1252

PDF, HTML = "application/pdf", "text/html"
# OpenAI's file_search types (less .doc, .docx and .pptx, which need a zip parser), a few
# more kinds of source and the text formats batch and fine-tuning files come in.
TYPES = {
    ".txt": "text/plain",
    ".md": "text/markdown",
    ".markdown": "text/markdown",
    ".rst": "text/x-rst",
    ".tex": "text/x-tex",
    ".html": HTML,
    ".htm": HTML,
    ".pdf": PDF,
    ".json": "application/json",
    ".jsonl": "application/jsonl",
    ".csv": "text/csv",
    ".tsv": "text/tab-separated-values",
    ".yaml": "application/yaml",
    ".yml": "application/yaml",
    ".toml": "application/toml",
    ".xml": "application/xml",
    ".sql": "application/sql",
    ".css": "text/css",
    ".py": "text/x-python",
    ".js": "text/javascript",
    ".mjs": "text/javascript",
    ".ts": "application/typescript",
    ".java": "text/x-java",
    ".kt": "text/x-kotlin",
    ".scala": "text/x-scala",
    ".c": "text/x-c",
    ".h": "text/x-c",
    ".cpp": "text/x-c++",
    ".cc": "text/x-c++",
    ".hpp": "text/x-c++",
    ".cs": "text/x-csharp",
    ".go": "text/x-golang",
    ".rs": "text/x-rust",
    ".swift": "text/x-swift",
    ".rb": "text/x-ruby",
    ".php": "text/x-php",
    ".sh": "application/x-sh",
}
TEXT_TYPES = frozenset(TYPES.values()) - {PDF}
SUPPORTED = ", ".join(sorted(TYPES))


class ExtractionError(Exception):
    """A file whose text cannot be had. `code` is OpenAI's word for it in a vector store
    file's `last_error`; `message` says why, for the one who uploaded it."""

    code = "invalid_file"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnsupportedFileError(ExtractionError):
    """A type this server does not read (the upload answers it with a 400)."""

    code = "unsupported_file"


def declared_type(filename: str) -> str:
    """The media type `filename`'s extension names (no charset yet): refused before any
    byte is stored when it is none that this server reads."""
    extension = Path(filename).suffix.lower()
    if not extension:
        raise UnsupportedFileError(
            f"files without an extension are not supported; supported: {SUPPORTED}"
        )
    if extension not in TYPES:
        raise UnsupportedFileError(
            f"files of type {extension} are not supported; supported: {SUPPORTED}"
        )
    return TYPES[extension]


def media_type_of(filename: str, head: bytes, complete: bool = False) -> str:
    """The media type a file is stored as: its extension's, if its first bytes (`head`;
    `complete` when that is the whole file) agree. A PDF must start with `%PDF-`; a text
    type must hold no NUL byte and decode as UTF-8 (else as Windows-1252), which the type
    then names as its charset."""
    media_type = declared_type(filename)
    if not head:
        raise UnsupportedFileError(f"{filename} is empty")
    if media_type == PDF:
        if not head.startswith(b"%PDF-"):
            raise UnsupportedFileError(f"{filename} does not start as a PDF does (%PDF-)")
        return PDF
    if b"\0" in head:
        raise UnsupportedFileError(f"{filename} holds NUL bytes: it is not a text file")
    try:  # incrementally: a character cut in two at the end of `head` is not an error
        codecs.getincrementaldecoder(UTF8)().decode(head, final=complete)
        charset = UTF8
    except UnicodeDecodeError:
        try:
            head.decode(LEGACY)
        except UnicodeDecodeError:
            raise UnsupportedFileError(
                f"{filename} is neither UTF-8 nor Windows-1252 text"
            ) from None
        charset = LEGACY
    return f"{media_type}; charset={charset}"


def extract_text(path: Path, media_type: str, max_chars: int) -> str:
    """The text of the file at `path`, stored as `media_type`: a text type decoded, HTML's
    visible text, a PDF's text page by page. ExtractionError when it cannot be had or
    passes `max_chars`."""
    base, _, params = media_type.partition(";")
    base = base.strip().lower()
    if base == PDF:
        return _pdf_text(path, max_chars)
    if base not in TEXT_TYPES:
        raise UnsupportedFileError(f"no text can be extracted from {media_type}")
    charset = LEGACY if LEGACY in params.lower() else UTF8
    if base == HTML:  # the markup may be far longer than the text: bound the text only
        return _html_text(_decoded(path, charset, None), max_chars)
    return _decoded(path, charset, max_chars)


def _too_long(max_chars: int) -> ExtractionError:
    return ExtractionError(
        f"the file's text passes {max_chars:,} characters (files.max_text_chars)"
    )


def _decoded(path: Path, charset: str, max_chars: int | None) -> str:
    # A character is at most 4 bytes: a file over 4 bytes a character is too long unread.
    if max_chars is not None and path.stat().st_size > 4 * max_chars:
        raise _too_long(max_chars)
    data = path.read_bytes()
    if b"\0" in data:  # the upload sniffed only the file's start
        raise ExtractionError("the file holds NUL bytes past its start: it is not a text file")
    # utf-8-sig drops a byte-order mark; a stray bad byte past the sniffed start is one
    # replacement character, not a lost file.
    text = data.decode("utf-8-sig" if charset == UTF8 else charset, errors="replace")
    if max_chars is not None and len(text) > max_chars:
        raise _too_long(max_chars)
    return text


# ---- HTML --------------------------------------------------------------------------------
SKIPPED = frozenset({"script", "style", "template", "noscript"})  # never shown as text
HTML_SPACE = " \t\n\r\f"  # what HTML collapses (never a no-break space)
# Elements that end a paragraph or a line (as words: a list of 30 names reads worse).
PARAGRAPHS = frozenset(
    "p div section article header footer main nav aside h1 h2 h3 h4 h5 h6 ul ol dl table "  # noqa: SIM905
    "blockquote figure figcaption form fieldset hr pre title address details summary".split()
)
LINES = frozenset("br li tr dt dd caption option".split())  # noqa: SIM905


class _VisibleText(HTMLParser):
    """The text a browser would show, with a blank line between blocks and a line break
    at <br>, <li> and table rows; whitespace collapsed as HTML does, except in <pre>."""

    def __init__(self, max_chars: int) -> None:
        super().__init__(convert_charrefs=True)
        self.max_chars = max_chars
        self.out: list[str] = []
        self.chars = 0
        self.skipping = 0  # depth inside SKIPPED elements
        self.pre = 0  # depth inside <pre>
        self.pending = ""  # the break owed before the next text
        self.after_space = True  # collapse a space that follows another (or a break)

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in SKIPPED:
            self.skipping += 1
        elif tag == "pre":
            self.pre += 1
        self._break(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in SKIPPED:
            self.skipping = max(0, self.skipping - 1)
        elif tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag not in LINES:  # </li> ends nothing that <li> did not
            self._break(tag)

    def handle_data(self, data: str) -> None:
        if self.skipping or not data:
            return
        if not self.pre:
            data = re.sub(f"[{HTML_SPACE}]+", " ", data)
            if self.after_space or self.pending:
                data = data.lstrip(" ")
            if not data:
                return
        self._emit(self.pending + data)
        self.pending = ""
        self.after_space = data[-1] in HTML_SPACE

    def _break(self, tag: str) -> None:
        kind = "\n\n" if tag in PARAGRAPHS else "\n" if tag in LINES else ""
        if self.out and len(kind) > len(self.pending):
            self.pending = kind

    def _emit(self, text: str) -> None:
        self.chars += len(text)
        if self.chars > self.max_chars:
            raise _too_long(self.max_chars)
        self.out.append(text)

    def text(self) -> str:
        return re.sub(r" +\n", "\n", "".join(self.out)).strip()


# "</", "<!" or "<?" that opens nothing html.parser can close: a browser hides it (a bogus
# comment), the parser takes it apart one character at a time at close(), copying the
# rest each time (quadratic: a MiB of "</ " took a minute). As text they cost nothing.
# Other malformed markup is as slow ("<a<a<a..."): the ingestor parses HTML in a child
# bounded in time (extract_child.py).
BOGUS_OPEN = re.compile(r"<(?=/[^A-Za-z>]|/\Z|![^A-Za-z\[-]|!\Z|\?)")


def _html_text(html: str, max_chars: int) -> str:
    html = BOGUS_OPEN.sub("&lt;", html)
    parser = _VisibleText(max_chars)
    for start in range(0, len(html), FEED_CHARS):
        parser.feed(html[start : start + FEED_CHARS])
    parser.close()
    return parser.text()


# ---- PDF ---------------------------------------------------------------------------------
def _pdf_text(path: Path, max_chars: int) -> str:
    """Page by page, a blank line between pages; pypdf bounds each stream it inflates."""
    from pypdf import PdfReader  # here: only a PDF's extraction needs it, not the ingress

    pages: list[str] = []
    chars = 0
    try:
        reader = PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):  # an empty user password opens many
            raise ExtractionError("the PDF is encrypted with a password")
        count = len(reader.pages)
        if count > MAX_PDF_PAGES:
            raise ExtractionError(
                f"the PDF has {count:,} pages; at most {MAX_PDF_PAGES:,} are read"
            )
        for page in reader.pages:
            text = (page.extract_text() or "").strip()
            chars += len(text) + 2
            if chars > max_chars:
                raise _too_long(max_chars)
            pages.append(text)
    except ExtractionError:
        raise
    except Exception as exc:  # noqa: BLE001  (a broken PDF raises pypdf's errors and any other)
        raise ExtractionError(f"the PDF could not be read: {exc}") from exc
    return "\n\n".join(p for p in pages if p)

"""A file's type at upload and its text at indexing (deployments/retrieval/extract.py):
the two agree on every type, and every bound (characters, pages) fails the file with an
ExtractionError that says why."""

import pytest

from deployments.retrieval import extract
from deployments.retrieval.extract import (
    TYPES,
    ExtractionError,
    UnsupportedFileError,
    extract_text,
    media_type_of,
)


def make_pdf(pages: list[str]) -> bytes:
    """A minimal valid PDF, one page per string, each drawing it in Helvetica."""
    count = len(pages)
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(count))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        f"<< /Type /Pages /Kids [{kids}] /Count {count} >>".encode(),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for i, text in enumerate(pages):
        content = f"BT /F1 12 Tf 72 720 Td ({text}) Tj ET".encode()
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
            b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (5 + 2 * i)
        )
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content))
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        xref,
    )
    return bytes(out)


def written(tmp_path, name: str, data: bytes):  # noqa: ANN001, ANN201
    path = tmp_path / name
    path.write_bytes(data)
    return path


# ---- the type at upload ------------------------------------------------------------------
def test_text_types_name_the_charset_they_decode_as():
    assert media_type_of("a.txt", "naïve".encode()) == "text/plain; charset=utf-8"
    assert media_type_of("A.PY", b"x = 1") == "text/x-python; charset=utf-8"
    assert media_type_of("old.md", b"caf\xe9 au lait") == "text/markdown; charset=windows-1252"
    assert media_type_of("d.pdf", b"%PDF-1.7\n") == "application/pdf"


def test_a_character_cut_at_the_sniffs_end_is_not_a_bad_byte():
    cut = "é".encode()[:1]
    assert media_type_of("a.txt", b"ok " + cut).endswith("charset=utf-8")
    # The whole file ending mid-character is not UTF-8.
    assert media_type_of("a.txt", b"ok " + cut, complete=True).endswith("windows-1252")


@pytest.mark.parametrize(
    ("name", "head", "words"),
    [
        ("deck.pptx", b"PK", "files of type .pptx are not supported; supported: .c, .cc"),
        ("README", b"hi", "files without an extension are not supported"),
        ("a.pdf", b"  %PDF-1.4", "does not start as a PDF does"),
        ("a.txt", b"\xff\xfeh\x00i\x00", "NUL bytes"),  # UTF-16
        ("a.txt", b"\x81\x8d", "neither UTF-8 nor Windows-1252"),  # bytes neither defines
        ("a.txt", b"", "is empty"),
    ],
)
def test_what_the_upload_refuses(name, head, words):
    with pytest.raises(UnsupportedFileError) as refused:
        media_type_of(name, head)
    assert words in refused.value.message and refused.value.code == "unsupported_file"


def test_every_type_the_upload_takes_extracts(tmp_path):
    for extension in TYPES:
        data = make_pdf(["Same words"]) if extension == ".pdf" else b"Same words"
        media_type = media_type_of(f"f{extension}", data, complete=True)
        assert extract_text(written(tmp_path, f"f{extension}", data), media_type, 100) == (
            "Same words"
        ), extension


# ---- text --------------------------------------------------------------------------------
def test_text_decodes_with_its_charset_and_drops_a_bom(tmp_path):
    utf8 = written(tmp_path, "a.txt", b"\xef\xbb\xbfna\xc3\xafve\n")
    legacy = written(tmp_path, "b.txt", b"caf\xe9 \x80")
    assert extract_text(utf8, "text/plain; charset=utf-8", 100) == "naïve\n"
    assert extract_text(legacy, "text/plain; charset=windows-1252", 100) == "café €"


def test_text_past_max_chars_fails(tmp_path):
    path = written(tmp_path, "a.txt", "é".encode() * 10)  # 20 bytes, 10 characters
    assert extract_text(path, "text/plain; charset=utf-8", 10) == "é" * 10
    with pytest.raises(ExtractionError, match="passes 9 characters"):
        extract_text(path, "text/plain; charset=utf-8", 9)
    with pytest.raises(ExtractionError, match="passes 4 characters"):  # refused unread
        extract_text(path, "text/plain; charset=utf-8", 4)


def test_a_nul_past_the_sniffed_start_fails(tmp_path):
    path = written(tmp_path, "a.txt", b"text" * 10 + b"\x00")
    with pytest.raises(ExtractionError, match="NUL") as failed:
        extract_text(path, "text/plain; charset=utf-8", 1000)
    assert failed.value.code == "invalid_file"


def test_a_type_it_cannot_read_fails(tmp_path):
    with pytest.raises(UnsupportedFileError):
        extract_text(written(tmp_path, "a.png", b"\x89PNG"), "image/png", 100)


# ---- HTML --------------------------------------------------------------------------------
PAGE = """<!doctype html><html><head><title>Title</title>
<style>body { color: red }</style>
<script>document.write("<p>never shown</p>"); var secret = 1;</script></head>
<body><h1>Heading   one</h1>
<p>First   paragraph with <b>bold</b> and&nbsp;an &amp; entity.</p>
<div>Line<br>break</div><ul><li>one</li><li>two</li></ul>
<pre>  kept
    as is</pre><noscript>Enable JavaScript</noscript><template><p>inert</p></template>
<p>Last.</p></body></html>"""


def test_html_gives_its_visible_text_in_paragraphs(tmp_path):
    text = extract_text(written(tmp_path, "p.html", PAGE.encode()), "text/html; charset=utf-8", 999)
    assert text == (
        "Title\n\nHeading one\n\nFirst paragraph with bold and\xa0an & entity.\n\n"
        "Line\nbreak\n\none\ntwo\n\n  kept\n    as is\n\nLast."
    )
    assert "secret" not in text and "color" not in text and "inert" not in text


def test_html_is_bounded_by_its_text_not_its_markup(tmp_path):
    markup = "<div class='wrapper'>" * 500 + "<p>short</p>"  # 10,000 characters of markup
    path = written(tmp_path, "m.html", markup.encode())
    assert extract_text(path, "text/html; charset=utf-8", 10) == "short"
    bomb = written(tmp_path, "b.html", ("<p>" + "words " * 1000 + "</p>").encode())
    with pytest.raises(ExtractionError, match="passes 100 characters"):
        extract_text(bomb, "text/html; charset=utf-8", 100)


# ---- PDF ---------------------------------------------------------------------------------
def test_a_pdfs_text_page_by_page(tmp_path):
    path = written(tmp_path, "d.pdf", make_pdf(["Hello from page one", "", "Page three"]))
    assert extract_text(path, "application/pdf", 1000) == "Hello from page one\n\nPage three"


def test_a_pdf_past_max_chars_or_pages_fails(tmp_path, monkeypatch):
    path = written(tmp_path, "d.pdf", make_pdf(["x" * 50, "y" * 50]))
    with pytest.raises(ExtractionError, match="passes 80 characters"):
        extract_text(path, "application/pdf", 80)
    monkeypatch.setattr(extract, "MAX_PDF_PAGES", 1)
    with pytest.raises(ExtractionError, match="the PDF has 2 pages; at most 1 are read"):
        extract_text(path, "application/pdf", 1000)


def test_a_broken_pdf_fails_with_pypdfs_reason(tmp_path):
    path = written(tmp_path, "d.pdf", b"%PDF-1.4\nthis is no PDF at all")
    with pytest.raises(ExtractionError, match="the PDF could not be read") as failed:
        extract_text(path, "application/pdf", 1000)
    assert failed.value.code == "invalid_file"


def test_a_compression_bomb_in_a_pdf_fails_without_inflating_it(tmp_path):
    """A page whose content stream inflates from 0.2 MB to 200 MB: pypdf's own bound on a
    stream's output (75 MB) stops it, so the page has no text (and the file then fails to
    index: it has none), in a fraction of the time parsing 200 MB would take."""
    import time
    import zlib

    from pypdf import PdfWriter
    from pypdf.generic import NameObject, StreamObject

    writer = PdfWriter()
    page = writer.add_blank_page(612, 792)
    stream = StreamObject()
    stream.set_data(zlib.compress(b" " * (200 * 1024 * 1024), 9))
    stream[NameObject("/Filter")] = NameObject("/FlateDecode")
    page[NameObject("/Contents")] = writer._add_object(stream)
    path = tmp_path / "bomb.pdf"
    with path.open("wb") as out:
        writer.write(out)
    assert path.stat().st_size < 1024 * 1024
    started = time.perf_counter()
    assert extract_text(path, "application/pdf", 16 * 1024 * 1024) == ""
    assert time.perf_counter() - started < 10


def test_a_child_reads_as_this_process_does_and_is_stopped_past_its_time(tmp_path):
    """HTML and PDF are parsed in a child bounded in time: it answers what extract_text
    answers, errors included, and a page that would take minutes fails at the bound."""
    import time

    from deployments.retrieval.extract_child import extract_in_child

    page = tmp_path / "page.html"
    page.write_text("<p>One</p><script>x()</script><p>Two &amp; </ three</p>")
    html = "text/html; charset=utf-8"
    assert extract_in_child(page, html, 1000) == extract_text(page, html, 1000)
    assert "Two & </ three" in extract_in_child(page, html, 1000)
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4 nothing more")
    with pytest.raises(ExtractionError, match="PDF could not be read"):
        extract_in_child(broken, "application/pdf", 1000)
    slow = tmp_path / "slow.html"
    slow.write_text("<a" * 200_000)  # html.parser: tens of seconds (quadratic)
    started = time.perf_counter()
    with pytest.raises(ExtractionError, match="took more than 2 s"):
        extract_in_child(slow, html, 16 * 1024 * 1024, timeout_s=2)
    assert time.perf_counter() - started < 10

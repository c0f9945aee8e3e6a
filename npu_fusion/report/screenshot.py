"""Render a report page in headless Chromium and tell a rendered page from a blank one.

Render a report page in a real headless browser and look at the result, without a dependency:
:func:`screenshot` runs Chromium (Debian's ``chromium`` package, or Google Chrome) headless on the
page and :func:`png_summary` decodes the PNG it writes (8-bit RGB or RGBA, not interlaced: what
Chromium writes) with ``zlib`` alone, to tell a page that rendered from a blank one."""
from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import subprocess
import zlib
from typing import List, Optional

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_browser() -> Optional[str]:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(page: str, png: str, width: int = 1280, height: int = 1600, timeout: int = 120) -> None:
    """Render ``page`` (an HTML file) at ``width`` x ``height`` CSS pixels into ``png``."""
    browser = find_browser()
    if browser is None:
        raise FileNotFoundError("no Chromium found (apt-get install chromium)")
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               "--no-first-run", "--disable-extensions", f"--window-size={width},{height}",
               f"--screenshot={os.path.abspath(png)}", "file://" + os.path.abspath(page)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 or not os.path.exists(png):
        raise RuntimeError(f"{browser} failed ({proc.returncode}): {proc.stderr[-2000:]}")


@dataclasses.dataclass
class PngSummary:
    width: int
    height: int
    colours: int          # distinct pixel colours
    non_white: float      # share of pixels that are not (near) white
    coloured: List[str]   # which of the report's marks (green, red, blue) appear


def png_summary(path: str) -> PngSummary:
    """Decode ``path`` and count what is on it."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    width = height = channels = 0
    idat = b""
    at = 8
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        chunk = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour_type, _, _, interlace = struct.unpack(">IIBBBBB", chunk)
            if depth != 8 or colour_type not in (2, 6) or interlace:
                raise ValueError(f"unsupported PNG layout (depth {depth}, colour type {colour_type})")
            channels = 3 if colour_type == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        at += 12 + length
    pixels = _unfiltered(zlib.decompress(idat), width, height, channels)
    return _summarize(pixels, width, height, channels)


def _unfiltered(raw: bytes, width: int, height: int, channels: int) -> List[bytearray]:
    """The PNG rows without their per-row filters (PNG specification, section 9)."""
    stride, rows, previous = width * channels, [], bytearray(width * channels)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, corner = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + ((left + up) >> 1)) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                line[i] = (line[i] + (left if pa <= pb and pa <= pc else up if pb <= pc else corner)) & 0xFF
        rows.append(line)
        previous = line
    return rows


def _summarize(rows: List[bytearray], width: int, height: int, channels: int) -> PngSummary:
    colours, non_white = set(), 0
    marks = {"green": (0x2E, 0x7D, 0x32), "red": (0xC6, 0x28, 0x28), "blue": (0x15, 0x65, 0xC0)}
    seen = set()
    for line in rows:
        for x in range(0, width * channels, channels):
            pixel = (line[x], line[x + 1], line[x + 2])
            colours.add(pixel)
            if min(pixel) < 240:
                non_white += 1
    for name, rgb in marks.items():
        if any(all(abs(a - b) <= 8 for a, b in zip(c, rgb)) for c in colours):
            seen.add(name)
    return PngSummary(width, height, len(colours), non_white / max(1, width * height), sorted(seen))

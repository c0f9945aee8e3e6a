"""Render an ``npu-fusion report --html`` page in headless Chromium and check the screenshot.

    python -m scripts.html_screenshot report.html report.png [--width 1200] [--height 1500]

Writes the PNG, prints what is on it (size, colours, share of non-white pixels, which of the
report's marks appear) and exits 1 when it looks blank (a page that did not render). Needs
Debian's ``chromium`` package (``apt-get install chromium``) or Google Chrome.
"""
import argparse
import sys

from npu_fusion.report import screenshot


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("page")
    parser.add_argument("png")
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--height", type=int, default=1500)
    args = parser.parse_args(argv)
    screenshot.screenshot(args.page, args.png, args.width, args.height)
    shot = screenshot.png_summary(args.png)
    print(f"{args.png}: {shot.width}x{shot.height}, {shot.colours} colours, "
          f"{100 * shot.non_white:.1f}% non-white, marks: {', '.join(shot.coloured) or 'none'}")
    blank = shot.colours < 50 or shot.non_white < 0.01
    if blank:
        print("the screenshot looks blank: the page did not render", file=sys.stderr)
    return 1 if blank else 0


if __name__ == "__main__":
    sys.exit(main())

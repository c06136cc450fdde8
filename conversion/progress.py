"""Progress reporting on stderr (stdout holds only the final summary)."""

import math
import sys


def say(quiet, msg):
    if not quiet:
        print(msg, file=sys.stderr, flush=True)


class Progress:
    """A tqdm bar over bytes when tqdm is installed, else a line every 5%; nothing when quiet."""

    def __init__(self, total, desc, quiet):
        self.total, self.done, self.desc, self.quiet, self._next = max(int(total), 1), 0, desc, quiet, 0.05
        self.bar = None
        if quiet:
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            print(f"{desc}: {self.total / 1e9:.3f} GB", file=sys.stderr, flush=True)
            return
        self.bar = tqdm(total=self.total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def update(self, n):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif not self.quiet and self.done / self.total >= self._next:
            print(f"{self.desc}: {100 * self.done / self.total:5.1f}%", file=sys.stderr, flush=True)
            self._next = math.floor(self.done / self.total * 20 + 1) / 20

    def close(self):
        if self.bar is not None:
            self.bar.close()

"""What keeps a run safe from faults: checksums of every saved array
(`integrity.py`), one writer per workdir (`lock.py`), and multi-host peers
that end together when one stalls or dies (`peers.py`)."""

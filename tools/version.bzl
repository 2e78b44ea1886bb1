"""The single version source for all three packages (they release together)."""

VERSION = "0.1.0"

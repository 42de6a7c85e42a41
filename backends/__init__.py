"""Persistent tiers behind one small interface: LMDB values and NVMe segment files."""

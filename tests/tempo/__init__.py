"""Tests of tempo."""

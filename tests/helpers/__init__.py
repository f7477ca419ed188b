"""Modules the tests share: loopback servers, the malformed-header corpus, torch file writers, tiny check
fixtures and the differential fuzz settings."""

"""docs/performance.md: the result files' sections, the README's headline table, the plots."""

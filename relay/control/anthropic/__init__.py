"""
C{anthropic_models} over the admin API (behaviour.md R115): the
C{claude-*} family -> OpenAI model table, read and changed live.
"""

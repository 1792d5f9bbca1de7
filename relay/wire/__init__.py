"""
Wire helpers with no policy: JSON codec, SSE framing, the Redis client
and the send-now transport helper.
"""

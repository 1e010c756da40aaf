"""Link sharing's numerics: the water-filling allocator over sigmoid utility curves, the
utility model those curves come from, and the allocator's offline bound. No protocol state:
the host layer (kvtransport.hosts.link_share) turns the allocator's shares into rates.
"""

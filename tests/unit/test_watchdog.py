"""A rank ends itself when another rank of its run has failed, instead of hanging in a collective."""





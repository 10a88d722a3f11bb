from rest_framework import pagination


class CursorPagination(pagination.CursorPagination):
    ordering = "-id"
    page_size_query_param = "page_size"
    max_page_size = 200
